"""Imports run one way (docs/design.md): the library never imports a stage, a stage imports another only
downward, the toolkit (library and stages) never imports the benchmarks or the tests, no module circles, and
imports inside functions only for optional or measurably costly packages.

The check reads the source (ast), so it sees imports hidden in functions that running the code would not."""
import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = "hybridlm"
STAGES = ("pretrain", "distill", "smart_select", "upcycle")
# stage -> the stages it may build on (SMART measures its KL with the distillation loss; the route composes the
# distillation stages and the SMART stage)
STAGE_DEPENDS = {"pretrain": set(), "distill": set(), "smart_select": {"distill"}, "upcycle": {"distill", "smart_select"}}
# above the stages, outside the installed wheel: they may import the toolkit, the toolkit never imports them
BENCHMARKS = "benchmarks"
OUTSIDE_THE_TOOLKIT = (BENCHMARKS, "tests", "conftest")
# packages a function may import on use, and why (the import costs measured after torch + transformers on the
# CI machine; the optional ones are extras or GPU-only)
LAZY_OK = {
    "fla": "GPU-only Triton kernels: 4.8 s to import, and it can fail on a machine without a driver",
    "triton": "GPU-only, as fla",
    "deepspeed": "0.33 s and its op-builder probing, only where the engine or its checkpoints are touched",
    "matplotlib": "0.42 s, only where a chart is drawn",
    "datasets": "0.6 s, only where a source is a Hugging Face dataset",
    "pyarrow": "only for parquet sources",
    "rdata": "0.43 s, only for the one corpus shipped as an R data file",
    "lm_eval": "optional extra (lm-eval harness)",
    "transformers": "the Llama / Auto model classes (0.29 s), only where a teacher or a peer is built",
    "torch.utils.tensorboard": "tensorboard is optional",
}


def _modules():
    mods = {}
    for pkg in (LIBRARY, *STAGES):
        for f in sorted((REPO / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(REPO).with_suffix("").parts)
            mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = f
    return mods


MODULES = _modules()


def _targets(module: str, node) -> set:
    """The project modules an import statement loads (``from pkg import submodule`` -> the submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            keep = len(parts) - node.level + (1 if MODULES[module].name == "__init__.py" else 0)
            base = ".".join(parts[:keep] + ([node.module] if node.module else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        names = subs if len(subs) == len(node.names) else [base, *subs]
    out = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def _imports():
    """(module, line, module imported, project targets, inside a function?) per import statement."""
    rows = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    top = (child.module or "") if isinstance(child, ast.ImportFrom) else child.names[0].name
                    if isinstance(child, ast.ImportFrom) and child.level:
                        top = module
                    rows.append((module, child.lineno, top, _targets(module, child), in_function))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(tree, False)
    return rows


IMPORTS = _imports()


def _graph():
    edges = defaultdict(set)
    for module, _, _, targets, _ in IMPORTS:
        edges[module] |= targets
    return edges


def test_the_scan_sees_the_tree():
    # the check cannot pass by scanning nothing: the packages and their known edges are there
    assert {"hybridlm.model.modeling", "upcycle.route", "distill.kd", "smart_select.selection"} <= set(MODULES)
    assert "hybridlm.model" in _graph()["upcycle.init_students"]
    assert len(IMPORTS) > 500


def test_the_library_never_imports_a_stage():
    bad = [f"{m}:{line} -> {sorted(t)}" for m, line, _, targets, _ in IMPORTS if m.split(".")[0] == LIBRARY
           for t in [{x for x in targets if x.split(".")[0] in STAGES}] if t]
    assert not bad, "the library (hybridlm/) imports a stage:\n" + "\n".join(bad)


def test_stages_import_each_other_only_downward():
    bad = []
    for m, line, _, targets, _ in IMPORTS:
        stage = m.split(".")[0]
        if stage in STAGES:
            for t in targets:
                other = t.split(".")[0]
                if other in STAGES and other != stage and other not in STAGE_DEPENDS[stage]:
                    bad.append(f"{m}:{line} -> {t}")
    assert not bad, "a stage imports a stage it does not build on:\n" + "\n".join(bad)


def test_the_toolkit_never_imports_benchmarks_or_tests():
    # benchmarks/ and tests/ are not in the wheel: an import of them works in a checkout and fails once installed
    bad = [f"{m}:{line} imports {imported}" for m, line, imported, _, _ in IMPORTS
           if imported.split(".")[0] in OUTSIDE_THE_TOOLKIT]
    assert not bad, "the toolkit imports benchmarks/ or tests/:\n" + "\n".join(bad)


def _benchmark_imports():
    """(file, line, module) for each import of a project module in benchmarks/ (``from M import name`` -> M)."""
    rows = []
    for f in sorted((REPO / BENCHMARKS).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            rows += [(f.relative_to(REPO), node.lineno, n) for n in names
                     if n.split(".")[0] in (LIBRARY, *STAGES, BENCHMARKS)]
    return rows


def _exists(module: str) -> bool:
    path = REPO.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_benchmarks_import_modules_that_exist():
    # the benchmarks sit on top of the toolkit; a module moved or removed there shows here, not on a GPU host
    rows = _benchmark_imports()
    assert any(m.startswith(f"{BENCHMARKS}.harness.") for _, _, m in rows), "the scan sees no benchmark import"
    bad = [f"{f}:{line} imports {m}" for f, line, m in rows if not _exists(m)]
    assert not bad, "benchmarks/ imports modules that do not exist:\n" + "\n".join(bad)


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            connect(v)
    return out


def test_no_import_circles():
    assert not _cycles(_graph()), f"modules importing each other: {_cycles(_graph())}"


def test_the_circle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _lazy_ok(imported: str, allowed: str) -> bool:
    return imported == allowed or imported.startswith(allowed + ".")


def test_imports_inside_functions_only_for_optional_or_costly_packages():
    bad = [f"{m}:{line} imports {imported}" for m, line, imported, _, in_function in IMPORTS
           if in_function and not any(_lazy_ok(imported, k) for k in LAZY_OK)]
    assert not bad, ("imports inside functions (move them to the top of the module, or add the package to "
                     "LAZY_OK with the measured reason):\n" + "\n".join(bad))


@pytest.mark.parametrize("package", sorted(LAZY_OK))
def test_every_lazy_exception_is_used(package):
    # an allowance nobody needs any more is removed, not kept as a silent hole
    assert any(in_function and _lazy_ok(imported, package) for _, _, imported, _, in_function in IMPORTS), package
