"""The engine's structure (docs/design.md, "The engine's rooms"): which modules may hold or touch a DeepSpeed
object at all, and how the engine's rooms stand.

Read from the source (ast), over every module of the toolkit:

* only the adapter (and hybridlm/patches.py, the one module that patches other libraries' code, DeepSpeed's op
  registry among them; tests/test_patches.py holds it to its list) imports DeepSpeed: a module ``deepspeed`` or ``deepspeed.*`` in an import statement, or named by
  a string (``importlib.import_module``, ``sys.modules``). One exception, :data:`PATCHED_REGISTRIES`: a registry of
  DeepSpeed's that the toolkit patches at start-up, which holds no object of a run;
* only the adapter names DeepSpeed's API: the attributes of its engine, optimizers, linked parameters and
  checkpoint files that the toolkit uses (:data:`DEEPSPEED_NAMES`, as an attribute or a string), and, in
  hybridlm/engine/, any private attribute (``x._name``, ``getattr(x, "_name")``) of an object other than ``self``
  or the ``torch`` module;
* only the adapter and the facade hold DeepSpeed's objects: no other module names a handle of them
  (:data:`HANDLES`, or an adapter's ``.deepspeed.engine`` / ``.optimizer`` / ``.lr_scheduler``); the facade hands
  them on (``loss_fn``'s model, ``Engine.ds_engine`` for callers that inspect it) without naming their API;
* hybridlm/engine/ stands on at most :data:`MAX_FLOORS` floors of imports between its modules (its ``__init__`` a
  thin face: imports and ``__all__`` only, not counted), the adapter on the ground floor: it imports no other
  module of the engine.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Dict, Iterable, List, Set

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLKIT = ("hybridlm", "pretrain", "distill", "smart_select", "upcycle")
TOOLKIT_SCRIPTS = ("pretrain.py",)
ENGINE = "hybridlm/engine/"
ADAPTER = "hybridlm/engine/deepspeed_adapter.py"
FACADE = "hybridlm/engine/engine.py"
PATCHES = "hybridlm/patches.py"
FACADE_MAX_LINES = 350
MAX_FLOORS = 4
FACE_MAX_LINES = 40
# patched where the process group is made (DeepSpeed's op registry: which ops it may JIT-build); no run's object
PATCHED_REGISTRIES = {"deepspeed.ops"}
# what the toolkit reaches in DeepSpeed's engine, its ZeRO / bf16 optimizers, the parameters they link, the LR
# scheduler they hold and their checkpoint files; none of these names is the toolkit's own or torch's
DEEPSPEED_NAMES = {
    # engine
    "basic_optimizer", "get_global_grad_norm", "enable_backward_allreduce", "checkpoint_engine",
    # BF16_Optimizer
    "get_grads_for_norm", "fp32_groups_gradient_flat_partition", "fp32_groups_flat_partition",
    "fp32_groups_actual_gradients_flat", "update_lp_params", "clear_hp_grads",
    # a linked parameter's fragment
    "lp_fragment_address", "hp_fragment_address", "param_group_index",
    # private attributes
    "_hp_mapping", "_link_all_hp_params", "_global_grad_norm", "_last_lr", "_lazy_init_hp_params_optimizer_state",
    "_hp_optimizer_states_linked", "_dp_group",
    # checkpoint files and the config dict
    "param_slice_mappings", "single_partition_of_fp32_groups", "base_optimizer_state", "zero_optimization",
    "train_micro_batch_size_per_gpu",
}
HANDLES = {"ds_engine", "zero_optimizer"}  # the toolkit's names for DeepSpeed's objects
ADAPTER_HANDLES = {"engine", "optimizer", "lr_scheduler"}  # attributes of a DeepSpeedAdapter (``x.deepspeed.<h>``)
OWN_TAGS = {"_no_weight_decay"}  # set by the toolkit's own layers on their parameters
NAME_BUILTINS = {"getattr", "setattr", "hasattr", "delattr"}
# the engine before the adapter: DeepSpeed reached from seven of its modules, 8 floors
BEFORE_ADAPTER_COMMIT = "5933c4dfa6886b930061890aef6f9f09ceaf5888"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_deepspeed_module(name: str) -> bool:
    return name == "deepspeed" or name.startswith("deepspeed.")


def _docstrings(tree: ast.AST) -> Set[int]:
    """ids of the docstring constants (a module's, a class's, a function's): prose, not code."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def deepspeed_touches(source: str, in_engine: bool, facade: bool = False) -> List[str]:
    """``line: what`` for each place ``source`` imports DeepSpeed, names its API or holds its objects."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_deepspeed_module(alias.name) and alias.name not in PATCHED_REGISTRIES:
                    hit(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _is_deepspeed_module(node.module):
                names = [f"{node.module}.{a.name}" for a in node.names]
                if node.module not in PATCHED_REGISTRIES and not set(names) <= PATCHED_REGISTRIES:
                    hit(node, f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if (_is_deepspeed_module(node.value) and node.value not in PATCHED_REGISTRIES) or \
                    node.value in DEEPSPEED_NAMES:
                hit(node, repr(node.value))
        elif isinstance(node, ast.Attribute):
            obj, name = node.value, node.attr
            on_self_or_torch = isinstance(obj, ast.Name) and obj.id in ("self", "torch")
            if name in DEEPSPEED_NAMES or (in_engine and _private(name) and not on_self_or_torch
                                           and name not in OWN_TAGS):
                hit(node, ast.unparse(node))
            elif not facade and (name in HANDLES or (name in ADAPTER_HANDLES and isinstance(obj, ast.Attribute)
                                                     and obj.attr == "deepspeed")):
                hit(node, ast.unparse(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in NAME_BUILTINS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            name = node.args[1].value
            if in_engine and _private(name) and name not in OWN_TAGS and name not in DEEPSPEED_NAMES:
                hit(node, ast.unparse(node))
        elif isinstance(node, (ast.Name, ast.arg)) and not facade:
            name = node.id if isinstance(node, ast.Name) else node.arg
            if name in HANDLES:
                hit(node, name)
    return found


def _toolkit_files() -> Iterable[Path]:
    for pkg in TOOLKIT:
        yield from sorted((REPO / pkg).rglob("*.py"))
    for script in TOOLKIT_SCRIPTS:
        if (REPO / script).is_file():
            yield REPO / script


def test_only_the_adapter_touches_deepspeed():
    files = list(_toolkit_files())
    assert len(files) > 100 and (REPO / ADAPTER).is_file()  # the scan sees the tree
    bad = []
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        if rel in (ADAPTER, PATCHES):
            continue
        bad += [f"{rel}:{hit}" for hit in deepspeed_touches(f.read_text(), rel.startswith(ENGINE), rel == FACADE)]
    assert not bad, (f"DeepSpeed imported, its API named or its objects held outside {ADAPTER} (add a method "
                     f"there):\n" + "\n".join(bad))
    # the adapter does all of it: the check is not looking at nothing
    touches = "\n".join(deepspeed_touches((REPO / ADAPTER).read_text(), in_engine=True))
    for expected in ("import deepspeed", "from deepspeed.runtime.bf16_optimizer import", "_hp_mapping",
                     "enable_backward_allreduce", "get_grads_for_norm", "fp32_groups_gradient_flat_partition",
                     "_global_grad_norm", "param_slice_mappings", "basic_optimizer", "'deepspeed.comm'"):
        assert expected in touches, expected


def test_the_check_flags_what_it_should():
    source = "\n".join([
        "import deepspeed",  # 1
        "from deepspeed.runtime.bf16_optimizer import BF16_Optimizer",  # 2
        "def f(self, engine, sched, param, ds_engine):",  # 3: a handle as an argument
        "    self._own = engine.optimizer._global_grad_norm",  # 4: a known private name
        "    sched._last_lr = [1.0]",  # 5
        "    getattr(param, '_hp_mapping', None)",  # 6: a known name as a string
        "    engine.optimizer._some_new_private()",  # 7: any private name on another object (engine only)
        "    engine.enable_backward_allreduce = False",  # 8: DeepSpeed's public API
        "    x = self.deepspeed.optimizer",  # 9: an adapter's handle
        "    sys.modules.get('deepspeed.comm')",  # 10: DeepSpeed named by a string
        "    torch._foreach_norm([])",  # fine: torch
        "    param.__dict__, getattr(param, '_no_weight_decay', False)",  # fine: dunder, own tag
        "    import deepspeed.ops",  # fine: a patched registry
        "    self.deepspeed.backward(x)",  # fine: through the adapter
    ])
    lines = [int(h.split(":")[0]) for h in deepspeed_touches(source, in_engine=True)]
    assert sorted(set(lines)) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], lines
    # outside hybridlm/engine/ any private name is not DeepSpeed's; the known ones still are
    assert sorted(set(int(h.split(":")[0]) for h in deepspeed_touches(source, in_engine=False))) == \
        [1, 2, 3, 4, 5, 6, 8, 9, 10]
    # the facade may hold the handles, not name DeepSpeed's API
    assert sorted(set(int(h.split(":")[0]) for h in deepspeed_touches(source, in_engine=True, facade=True))) == \
        [1, 2, 4, 5, 6, 7, 8, 10]


# --------------------------------------------------------------------------------------------- floors


def engine_imports(sources: Dict[str, str]) -> Dict[str, Set[str]]:
    """For each module of hybridlm/engine/ (by file name), the modules of hybridlm/engine/ it imports
    (``from hybridlm.engine import checkpoint`` imports checkpoint.py; a name that is no module, ``__init__.py``)."""
    modules = {name[:-3] for name in sources}

    def module_of(dotted: str) -> str:
        parts = dotted.split(".")
        return parts[2] if len(parts) > 2 and parts[2] in modules else "__init__"

    out = {}
    for name, source in sources.items():
        deps = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                deps.update(module_of(a.name) for a in node.names if a.name.startswith("hybridlm.engine"))
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module == "hybridlm.engine":
                deps.update(module_of(f"hybridlm.engine.{a.name}") for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.startswith("hybridlm.engine."):
                deps.add(module_of(node.module))
        out[name] = {f"{d}.py" for d in deps} - {name}
    return out


def floors(imports: Dict[str, Set[str]]) -> Dict[str, int]:
    """Floor of each module: 1 when it imports no other module of the set, else one above the highest it imports."""
    memo: Dict[str, int] = {}

    def floor(name: str, path: tuple = ()) -> int:
        assert name not in path, f"import circle: {' -> '.join(path + (name,))}"
        if name not in memo:
            memo[name] = 1 + max((floor(d, path + (name,)) for d in imports.get(name, ()) if d in imports),
                                 default=0)
        return memo[name]

    return {name: floor(name) for name in imports}


def is_face(source: str) -> bool:
    """A package's face: imports, ``__all__`` and a docstring only, under :data:`FACE_MAX_LINES` lines."""
    tree = ast.parse(source)
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    only_hands_on = all(isinstance(n, (ast.Import, ast.ImportFrom)) or (
        isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"]) for n in body)
    return only_hands_on and len(source.splitlines()) < FACE_MAX_LINES


def engine_floors(sources: Dict[str, str]) -> Dict[str, int]:
    """Floors of hybridlm/engine/'s modules; a face ``__init__`` is not a floor (it only hands names on)."""
    if "__init__.py" in sources and is_face(sources["__init__.py"]):
        sources = {k: v for k, v in sources.items() if k != "__init__.py"}
    return floors(engine_imports(sources))


def test_the_engine_rooms_stand_side_by_side():
    sources = {f.name: f.read_text() for f in sorted((REPO / ENGINE).glob("*.py"))}
    assert is_face(sources["__init__.py"]), "hybridlm/engine/__init__.py: keep it a face (imports and __all__)"
    levels = engine_floors(sources)
    print("\n" + "\n".join(f"floor {n}  {ENGINE}{name}" for name, n in sorted(levels.items(), key=lambda x: -x[1])))
    assert max(levels.values()) <= MAX_FLOORS, levels
    assert levels["deepspeed_adapter.py"] == 1, "the adapter imports no other module of the engine"
    assert levels["engine.py"] == max(levels.values())  # the facade on top, its components below it
    assert len(sources["engine.py"].splitlines()) < FACADE_MAX_LINES


def test_the_checks_flag_the_engine_before_the_adapter():
    try:
        listed = subprocess.run(["git", "ls-tree", "--name-only", BEFORE_ADAPTER_COMMIT, ENGINE], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("git is not available")
    if listed.returncode != 0:
        pytest.skip(f"commit {BEFORE_ADAPTER_COMMIT[:12]} is not in this checkout")
    sources = {}
    for path in listed.stdout.split():
        shown = subprocess.run(["git", "show", f"{BEFORE_ADAPTER_COMMIT}:{path}"], cwd=REPO, capture_output=True,
                               text=True, timeout=60, check=True)
        sources[Path(path).name] = shown.stdout
    touching = {name for name, source in sources.items()
                if name != "engine.py" and deepspeed_touches(source, in_engine=True)}
    # DeepSpeed was reached from seven modules: BF16_Optimizer.step replaced and its partitions read, its norm's
    # gradients replaced, enable_backward_allreduce set, skipped_steps read through the held engine, its record
    # classes and its comm layer imported
    assert touching == {"device_step.py", "clipping.py", "deepspeed_build.py", "step_runner.py",
                        "checkpoint_store.py", "checkpoint.py", "distributed.py"}, touching
    assert not is_face(sources["__init__.py"])
    assert max(engine_floors(sources).values()) == 8
