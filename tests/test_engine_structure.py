"""The engine's structure (docs/design.md): one module touches DeepSpeed's private attributes, and the Engine
is a small facade over its components.

The check reads the source (ast). A DeepSpeed private attribute is, in practice:

* any ``x._name`` (or ``getattr(x, "_name")`` & co.) in hybridlm/engine/ on an object other than ``self``
  or the ``torch`` module, the toolkit's own ``_no_weight_decay`` tag aside;
* anywhere in the toolkit, an attribute named in :data:`DEEPSPEED_PRIVATE`.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLKIT = ("hybridlm", "pretrain", "distill", "smart_select", "upcycle")
ENGINE = "hybridlm/engine/"
THE_ONE_MODULE = "hybridlm/engine/checkpoint_store.py"
FACADE = "hybridlm/engine/engine.py"
FACADE_MAX_LINES = 350
# private attributes of DeepSpeed's engine, optimizers and parameters (and the LR scheduler it holds) that the
# toolkit needs
DEEPSPEED_PRIVATE = {"_hp_mapping", "_link_all_hp_params", "_global_grad_norm", "_last_lr",
                     "_lazy_init_hp_params_optimizer_state", "_hp_optimizer_states_linked", "_dp_group"}
OWN_TAGS = {"_no_weight_decay"}  # set by the toolkit's own layers on their parameters
NAME_BUILTINS = {"getattr", "setattr", "hasattr", "delattr"}
# a commit whose engine.py (813 lines) touches DeepSpeed's private attributes: the check must flag it
MONOLITH_COMMIT = "141cef6031316bb898721768f10e086523637c88"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_accesses(source: str, in_engine: bool) -> List[str]:
    """``line: expression`` for each DeepSpeed private attribute ``source`` reads, writes or calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            obj, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in NAME_BUILTINS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            obj, name = node.args[0], node.args[1].value
        else:
            continue
        if not _private(name):
            continue
        on_self_or_torch = isinstance(obj, ast.Name) and obj.id in ("self", "torch")
        if name in DEEPSPEED_PRIVATE or (in_engine and not on_self_or_torch and name not in OWN_TAGS):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _toolkit_files():
    for pkg in TOOLKIT:
        yield from sorted((REPO / pkg).rglob("*.py"))


def test_only_the_checkpoint_store_touches_deepspeed_private_attributes():
    files = list(_toolkit_files())
    assert len(files) > 100 and (REPO / THE_ONE_MODULE).is_file()  # the scan sees the tree
    bad = []
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        if rel == THE_ONE_MODULE:
            continue
        bad += [f"{rel}:{hit}" for hit in private_accesses(f.read_text(), rel.startswith(ENGINE))]
    assert not bad, (f"DeepSpeed's private attributes outside {THE_ONE_MODULE} (add an accessor there):\n"
                     + "\n".join(bad))
    # the one module does touch them: the check is not looking at nothing
    assert private_accesses((REPO / THE_ONE_MODULE).read_text(), in_engine=True)


def test_the_check_flags_what_it_should():
    source = "\n".join([
        "def f(self, engine, sched, param):",
        "    self._own = engine.optimizer._global_grad_norm",  # a known name
        "    sched._last_lr = [1.0]",
        "    getattr(param, '_hp_mapping', None)",
        "    engine.optimizer._some_new_private()",  # any private name on a DeepSpeed object
        "    torch._foreach_norm([])",
        "    param.__dict__, getattr(param, '_no_weight_decay', False)",
    ])
    hits = private_accesses(source, in_engine=True)
    assert [h.split(":")[0] for h in hits] == ["2", "3", "4", "5"], hits
    # outside hybridlm/engine/ only the known names count
    assert [h.split(":")[0] for h in private_accesses(source, in_engine=False)] == ["2", "3", "4"]


def test_the_check_flags_the_engine_before_the_split():
    try:
        old = subprocess.run(["git", "show", f"{MONOLITH_COMMIT}:{FACADE}"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("git is not available")
    if old.returncode != 0:
        pytest.skip(f"commit {MONOLITH_COMMIT[:12]} is not in this checkout")
    hits = private_accesses(old.stdout, in_engine=True)
    for name in ("_hp_mapping", "_link_all_hp_params", "_global_grad_norm", "_last_lr"):
        assert any(name in h for h in hits), (name, hits)
    assert len(old.stdout.splitlines()) > FACADE_MAX_LINES


def test_the_engine_is_a_facade_over_one_module_per_component():
    counts = {f.name: len(f.read_text().splitlines()) for f in sorted((REPO / ENGINE).glob("*.py"))}
    print("\n" + "\n".join(f"{n:>5}  {ENGINE}{name}" for name, n in counts.items()))
    for component in ("deepspeed_build.py", "step_runner.py", "checkpoint_store.py"):
        assert component in counts, component
    assert counts["engine.py"] < FACADE_MAX_LINES, counts["engine.py"]
