"""Every patch of another library's code is declared in hybridlm/patches.py: the exact list, each applied from the
modules it names, each guarded by the versions it was written against, each installed (and idempotently) by its
install function; and nowhere else in the toolkit does code assign to another library's attributes (read from
the source, so a patch added anywhere else fails here)."""
from __future__ import annotations

import ast
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import List

import pytest

from hybridlm import patches as P
from tests.support.history import source_at

REPO = Path(__file__).resolve().parents[1]
TOOLKIT = ("hybridlm", "pretrain", "distill", "smart_select", "upcycle")
OURS = (*TOOLKIT, "benchmarks", "tests", "conftest", "__future__")
THE_MODULE = "hybridlm/patches.py"

# name -> scoped?, in the order hybridlm/patches.py declares them
EXPECTED = {
    "autotuner-shipped-results": False,
    "deepspeed-shm-comm-off": False,
    "torch-group-defaults-unpinned": False,
    "transformers-messages-held": True,
    "children-run-first": True,
    "vllm-hybrid-config": False,
}


def test_the_patch_list():
    assert {name: p.scoped for name, p in P.PATCHES.items()} == EXPECTED
    assert list(P.PATCHES) == list(EXPECTED)
    for name, patch in P.PATCHES.items():
        assert patch.name == name and patch.targets and len(patch.reason) > 100, name
        assert all(":" in t and t.partition(":")[0] and t.partition(":")[2] for t in patch.targets), patch.targets
        assert patch.versions, name
        for spec in patch.versions.values():
            P.within("0", spec)  # each spec parses (ValueError otherwise)
        for module in patch.applied_by:
            path = REPO.joinpath(*module.split("."))
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def test_the_versions_here_are_the_ones_written_for():
    """The guard of each patch admits the packages installed here (an absent package is not checked: vLLM in the
    training environment, DeepSpeed in the serving one)."""
    checked = []
    for patch in P.PATCHES.values():
        assert not P.outside_versions(patch), (patch.name, P.outside_versions(patch))
        checked += [p for p in patch.versions if P.installed_version(p) is not None]
    assert {"python", "torch", "transformers"} <= set(checked), checked


# ------------------------------------------------------------------------------------------------ where applied

def _toolkit_files() -> List[Path]:
    return [f for pkg in TOOLKIT for f in sorted((REPO / pkg).rglob("*.py"))]


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def applications(source: str) -> List[tuple]:
    """``(line, "apply" | "scope", patch name)`` for each ``patches.apply("name", ...)`` / ``patches.scope(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("apply", "scope")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "patches"):
            first = node.args[0] if node.args else None
            name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            found.append((node.lineno, node.func.attr, name))
    return found


def test_each_patch_is_applied_where_it_says_and_only_by_name():
    applied = {name: set() for name in P.PATCHES}
    bad = []
    for f in _toolkit_files():
        rel = f.relative_to(REPO).as_posix()
        for line, kind, name in applications(f.read_text()):
            patch = P.PATCHES.get(name)
            if patch is None or kind != ("scope" if patch.scoped else "apply"):
                bad.append(f"{rel}:{line}: patches.{kind}({name!r})")
            else:
                applied[name].add(_module_name(f))
    assert not bad, "applications of no declared patch, or of the wrong kind:\n" + "\n".join(bad)
    assert applied == {name: set(p.applied_by) for name, p in P.PATCHES.items()}


def test_the_kernel_choice_only_answers():
    """hybridlm/ops/backend.py (asked in every forward) installs nothing: no patch, no shipped tuning."""
    tree = ast.parse((REPO / "hybridlm/ops/backend.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"patches", "apply_shipped_tuning", "tuning"}, names
    assert not modules & {"hybridlm", "hybridlm.ops.tuning", "hybridlm.patches"}, modules


def test_the_design_doc_lists_the_patches():
    """docs/design.md's table of patches: one row per declared patch, in order, scoped ones marked, with the
    modules that apply it."""
    text = (REPO / "docs/design.md").read_text()
    section = text.split("## Patches of other libraries' code", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    listed = [(r[0].split("`")[1], r[0].endswith("(scoped)"), set(re.findall(r"`([\w.]+)`", r[2]))) for r in rows]
    assert listed == [(n, p.scoped, set(p.applied_by)) for n, p in P.PATCHES.items()]
    assert "**A patch**" in text.split("## Where to add", 1)[1]


# ------------------------------------------------------------------------------------------------ version guard

def test_versions_compare_on_release_numbers():
    assert P.release("2.13.0+cpu") == (2, 13, 0) and P.release("3.10.0rc1") == (3, 10, 0)
    assert P.within("3.7.1", ">=3.7,<3.10") and P.within("3.9", ">=3.7,<3.10")
    assert not P.within("3.10.0", ">=3.7,<3.10") and not P.within("3.6.9", ">=3.7,<3.10")
    assert P.within("0.19.8", ">=0.19.8,<0.20") and not P.within("0.20.0", ">=0.19.8,<0.20")
    with pytest.raises(ValueError, match="expected clauses"):
        P.within("1.0", "~=1.0")


def _toy(monkeypatch, scoped: bool, versions: dict):
    calls, undone = [], []

    def install(patch, value):
        calls.append(value)
        return (lambda: undone.append(value)) if scoped else None

    patch = P.Patch("toy", ("json:dumps",), versions, "a toy", ("tests.test_patches",), install, scoped)
    monkeypatch.setitem(P.PATCHES, "toy", patch)
    monkeypatch.setattr(P, "_GUARDED", set())
    return calls, undone


def test_outside_its_versions_a_patch_is_installed_and_says_so_once(monkeypatch):
    calls, _ = _toy(monkeypatch, scoped=False, versions={"python": "<3.0"})
    with pytest.warns(P.PatchVersionWarning) as said:
        P.apply("toy", 1)
        P.apply("toy", 2)
    assert calls == [1, 2] and len(said) == 1
    text = str(said[0].message)
    assert text.startswith("patch toy: installed on python ") and "(written for python<3.0)" in text
    assert said[0].filename == __file__  # the line that applies it
    with pytest.raises(TypeError, match="process-wide: use apply"):
        with P.scope("toy"):
            pass
    with pytest.raises(KeyError, match="no patch 'absent'"):
        P.apply("absent")


def test_within_its_versions_a_patch_says_nothing(monkeypatch):
    calls, _ = _toy(monkeypatch, scoped=False, versions={"python": ">=3.0", "torch": ">=2.0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P.apply("toy", 1)
    assert calls == [1]


def test_a_scoped_patch_is_installed_once_for_nested_blocks(monkeypatch):
    calls, undone = _toy(monkeypatch, scoped=True, versions={"python": ">=3.0"})
    with P.scope("toy", "first"):
        with P.scope("toy", "second"):
            assert P.open_scopes() == ["toy"] and calls == ["first"] and not undone
        assert not undone
    assert undone == ["first"] and "toy" not in P.open_scopes()
    with pytest.raises(RuntimeError):
        with P.scope("toy", "third"):
            raise RuntimeError("inside")
    assert undone == ["first", "third"] and "toy" not in P.open_scopes()  # undone on the way out of an error


def test_a_target_that_is_gone_is_one_clear_error():
    patch = P.Patch("toy", ("json:no_such_function",), {"python": ">=3.0"}, "a toy", (), lambda p: None)
    with pytest.raises(P.PatchError, match=r"patch toy: json:no_such_function does not exist here \(written for "
                                           r"python>=3.0\)"):
        P._resolve(patch, patch.targets[0])


# ------------------------------------------------------------------------------------------------ each installed

def test_autotuner_shipped_results(monkeypatch):
    from triton.runtime.autotuner import Autotuner
    monkeypatch.setattr(Autotuner, "check_disk_cache", Autotuner.check_disk_cache)  # restored after the test
    original = Autotuner.check_disk_cache
    seen = []

    def wrap(inner):
        seen.append(inner)

        def check_disk_cache(self, tuning_key, configs, bench_fn):
            return inner(self, tuning_key, configs, bench_fn)
        return check_disk_cache

    P.apply("autotuner-shipped-results", wrap)
    hooked = Autotuner.check_disk_cache
    assert seen == [original] and hooked is not original and P.installed_by(hooked) == "autotuner-shipped-results"
    P.apply("autotuner-shipped-results", wrap)  # idempotent: the first wrapper stays, nothing wrapped twice
    assert Autotuner.check_disk_cache is hooked and seen == [original]


def test_deepspeed_shm_comm_off():
    deepspeed_ops = pytest.importorskip("deepspeed.ops")
    P.apply("deepspeed-shm-comm-off")
    P.apply("deepspeed-shm-comm-off")
    assert deepspeed_ops.__compatible_ops__["deepspeed_shm_comm"] is False


GROUP_DEFAULTS = """
import importlib, json, sys
import torch.distributed as dist
from hybridlm import patches
name = patches.GROUP_DEFAULT_MODULES[0]

def pinned():
    module = sys.modules[name]
    return sorted(n for n, fn in vars(module).items() if getattr(fn, "__module__", None) == name
                  and any(isinstance(d, dist.ProcessGroup) for d in (getattr(fn, "__defaults__", None) or ())))

out = {"before": name in sys.modules}
patches.apply("torch-group-defaults-unpinned")  # before any group: imported, its defaults None
out["imported"], out["pinned_at_start"] = name in sys.modules, pinned()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
importlib.reload(sys.modules[name])  # an import ordered by someone else while a group exists
dist.destroy_process_group()
out["pinned_after_destroy"] = pinned()
patches.apply("torch-group-defaults-unpinned")
patches.apply("torch-group-defaults-unpinned")
out["pinned_after_apply"] = pinned()
print(json.dumps(out))
"""


def test_torch_group_defaults_unpinned():
    """A real gloo group frozen into torch.distributed.nn.functional's defaults (the module imported while it
    exists), dropped by the patch once destroyed; before any group, the patch imports the module unpinned."""
    res = subprocess.run([sys.executable, "-c", GROUP_DEFAULTS], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["before"] is False and out["imported"] is True and out["pinned_at_start"] == []
    assert "all_reduce" in out["pinned_after_destroy"] and len(out["pinned_after_destroy"]) >= 5, out
    assert out["pinned_after_apply"] == []


def test_transformers_messages_held():
    import transformers  # noqa: F401  (adds warning_once / info_once to logging.Logger)
    originals = (logging.Logger.handle, logging.Logger.warning_once, logging.Logger.info_once, warnings.warn)
    held = []

    def holding(name):
        return held if name.split(".")[0] == "transformers" else None

    said = logging.getLogger("transformers.generation.toy")
    with P.scope("transformers-messages-held", holding):
        with P.scope("transformers-messages-held", holding):  # nested: wrapped once
            wrapped = (logging.Logger.handle, logging.Logger.warning_once, logging.Logger.info_once, warnings.warn)
            assert all(P.installed_by(w) == "transformers-messages-held" for w in wrapped)
            said.warning("held")
            said.warning_once("held once")
            exec("import warnings\nwarnings.warn('held warning')", {"__name__": "transformers.toy"})
        assert (logging.Logger.handle, warnings.warn) == wrapped[::3]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn("not transformers': said")
        assert [str(w.message) for w in caught] == ["not transformers': said"]
    assert (logging.Logger.handle, logging.Logger.warning_once, logging.Logger.info_once, warnings.warn) == originals
    assert len(held) == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for replay in held:
            replay()
    assert [str(w.message) for w in caught] == ["held warning"] and caught[0].filename == "<string>"


def _child_marks(path: str) -> None:
    pass  # the marker is written by the patch's ``first`` before this runs


def test_children_run_first(tmp_path):
    """A child started inside the block runs ``first`` before its target (fork: the child inherits the wrapper);
    multiprocessing and, where installed, multiprocess are patched; both put back after."""
    import multiprocessing.process as mp_process
    originals = [mp_process.BaseProcess._bootstrap]
    try:
        import multiprocess.process as mpx_process
        originals.append(mpx_process.BaseProcess._bootstrap)
    except ImportError:  # pragma: no cover
        mpx_process = None
    marker = tmp_path / "first"
    with P.scope("children-run-first", lambda: marker.write_text(str(os.getpid()))):
        assert P.installed_by(mp_process.BaseProcess._bootstrap) == "children-run-first"
        if mpx_process is not None:
            assert P.installed_by(mpx_process.BaseProcess._bootstrap) == "children-run-first"
        child = multiprocessing.get_context("fork").Process(target=_child_marks, args=(str(marker),))
        child.start()
        child.join(60)
    assert child.exitcode == 0 and marker.read_text() == str(child.pid)
    assert mp_process.BaseProcess._bootstrap is originals[0]
    if mpx_process is not None:
        assert mpx_process.BaseProcess._bootstrap is originals[1]


def test_vllm_hybrid_config():
    pytest.importorskip("vllm")
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS

    class Settings:
        pass

    class Convertor:
        pass

    try:
        P.apply("vllm-hybrid-config", "ToyForCausalLM", Settings, "toy_type", Convertor)
        P.apply("vllm-hybrid-config", "ToyForCausalLM", object, "toy_type", object)  # an entry there stays
        assert MODELS_CONFIG_MAP["ToyForCausalLM"] is Settings and MODEL_ARCH_CONFIG_CONVERTORS["toy_type"] is Convertor
    finally:
        MODELS_CONFIG_MAP.pop("ToyForCausalLM", None)
        MODEL_ARCH_CONFIG_CONVERTORS.pop("toy_type", None)


# ------------------------------------------------------------------------------------------------ nowhere else

# what the toolkit may change outside hybridlm/patches.py, and why
ALLOWED = {"os.environ": "environment variables: settings the libraries read, not their code"}
MUTATORS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__", "append", "extend",
            "insert", "remove", "discard", "add"}


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node) -> str:
    return ast.unparse(node).split("[")[0]


def foreign_patches(source: str) -> List[str]:
    """``line: what`` for each change ``source`` makes to another library's objects: an assignment or deletion of
    an attribute or item of something imported from outside the toolkit (or an alias of one: ``m = pkg.module``,
    ``for m in (pkg.a, pkg.b)``), ``setattr`` / ``delattr`` on one, a mutating call on one of its attributes
    (``pkg.MAP.setdefault(...)``, ``MAP.update(...)`` for a name imported from it), and an assignment to a
    function's dunder attribute (``fn.__defaults__ = ...``) on anything."""
    tree = ast.parse(source)
    foreign, modules = set(), {}  # modules: a name bound by ``import`` -> the module's name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in OURS:
                    name = a.asname or a.name.split(".")[0]
                    foreign.add(name)
                    modules[name] = a.name if a.asname else name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] not in OURS:
            foreign.update(a.asname or a.name for a in node.names)

    def aliases(expr) -> bool:
        if isinstance(expr, (ast.Tuple, ast.List)):
            return any(aliases(e) for e in expr.elts)
        if isinstance(expr, ast.IfExp):
            return aliases(expr.body) or aliases(expr.orelse)
        return isinstance(expr, (ast.Attribute, ast.Name)) and _root(expr) in foreign

    grew = True
    while grew:  # names bound to a foreign module or object, or to a tuple of them, are foreign too
        grew = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and aliases(node.value):
                bound = [t for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.For) and aliases(node.iter) and isinstance(node.target, ast.Name):
                bound = [node.target]
            else:
                continue
            for t in bound:
                if t.id not in foreign:
                    foreign.add(t.id)
                    grew = True

    def allowed(node) -> bool:
        root, _, rest = _dotted(node).partition(".")
        dotted = f"{modules.get(root, root)}.{rest}" if rest else modules.get(root, root)
        return any(dotted == a or dotted.startswith(a + ".") for a in ALLOWED)

    hits = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if not isinstance(t, (ast.Attribute, ast.Subscript)) or allowed(t):
                    continue
                dunder = isinstance(t, ast.Attribute) and t.attr.startswith("__") and t.attr.endswith("__")
                if _root(t) in foreign or dunder:
                    hits.append(f"{node.lineno}: {ast.unparse(t)}")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args and _root(node.args[0]) in foreign:
                hits.append(f"{node.lineno}: {ast.unparse(node)[:100]}")
            elif (isinstance(f, ast.Attribute) and f.attr in MUTATORS and _root(f.value) in foreign
                  and not (isinstance(f.value, ast.Name) and f.value.id in modules) and not allowed(f.value)):
                hits.append(f"{node.lineno}: {ast.unparse(node)[:100]}")
    return hits


def test_no_patch_outside_the_patches_module():
    files = _toolkit_files()
    assert len(files) > 100 and (REPO / THE_MODULE).is_file()  # the scan sees the tree
    bad = []
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        if rel != THE_MODULE:
            bad += [f"{rel}:{hit}" for hit in foreign_patches(f.read_text())]
    assert not bad, ("changes to other libraries' code outside hybridlm/patches.py (declare a patch there: "
                     "docs/design.md, 'A patch'):\n" + "\n".join(bad))


def test_the_check_flags_what_it_should():
    source = "\n".join([
        "import logging, os, warnings",                           # 1
        "import multiprocessing.process",
        "from triton.runtime.autotuner import Autotuner",
        "from vllm.config import MAP",
        "from hybridlm.model import HybridConfig",                # 5
        "def f(fn, config):",
        "    logging.Logger.handle = fn",                         # 7  a class of an imported module
        "    warnings.warn = fn",                                 # 8
        "    Autotuner.check_disk_cache = fn",                    # 9  a class imported by name
        "    setattr(logging.Logger, 'info_once', fn)",           # 10
        "    MAP.setdefault('x', 1)",                             # 11 an imported map
        "    for m in (multiprocessing.process,):",
        "        m.BaseProcess._bootstrap = fn",                  # 13 through an alias
        "    fn.__defaults__ = (None,)",                          # 14
        "    os.environ['X'] = '1'; os.environ.setdefault('Y', '2')",  # 15 allowed: settings
        "    import os as _os; _os.environ['Z'] = '3'",
        "    HybridConfig.x = 1; config.runtime = 2",             # ours; an object's field
        "    os.remove('f'); logging.getLogger('x').setLevel(10)",  # calls, not changes
        "    import torch.nn as tnn; tnn.Module.forward = fn",      # 19 a module imported under another name
    ])
    assert sorted(int(h.split(":")[0]) for h in foreign_patches(source)) == [7, 8, 9, 10, 11, 13, 14, 19]


# the toolkit before its patches were gathered into hybridlm/patches.py: each then was in the room that needed it
SCATTERED_COMMIT = "86899f7b836da251ea64ce93d5b66c67eede9520"
SCATTERED = {
    "hybridlm/ops/tuning.py": ["Autotuner.check_disk_cache"],
    "hybridlm/model/fast_generate.py": ["logging.Logger.handle", "warnings.warn", "setattr(logging.Logger"],
    "hybridlm/data/prepare.py": ["module.BaseProcess._bootstrap"],
    "hybridlm/engine/distributed.py": ["deepspeed.ops.__compatible_ops__", "fn.__defaults__"],
    "hybridlm/serve/plugin.py": ["MODELS_CONFIG_MAP.setdefault", "MODEL_ARCH_CONFIG_CONVERTORS.setdefault"],
}


def test_the_check_flags_the_patches_where_they_were():
    for path, expected in SCATTERED.items():
        hits = foreign_patches(source_at(SCATTERED_COMMIT, path))
        for what in expected:
            assert any(what in h for h in hits), (path, what, hits)
