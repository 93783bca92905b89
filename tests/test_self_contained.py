"""The repository stands on its own: nothing in the product, its configs, tests or scripts reads a path outside
the checkout. Inputs come from the repository or from registry assets (``asset:NAME``, pinned by sha256)."""
import re
from pathlib import Path

import yaml

from conftest import REPO

CHECKED = ("hybridlm", "pretrain", "upcycle", "distill", "smart_select", "configs", "tests", "scripts", "benchmarks",
           "pretrain.py", "pyproject.toml", ".ci")
# A path that leaves the checkout: a sibling folder of it, or the repository root's parent.
OUTSIDE = re.compile(r"\.\./shared|\.\./data/|/shared/(data|device|seeds)\b|REPO\.parent|\.parent\.parent / \"shared")


TEXT = {".py", ".sh", ".yaml", ".yml", ".json", ".toml", ".md", ".txt", ".cfg", ""}


def product_files():
    """The text files of the checked places (works in a copy without .git, as .ci/run's is)."""
    for name in CHECKED:
        root = REPO / name
        for f in ([root] if root.is_file() else sorted(root.rglob("*"))):
            if f.is_file() and f.suffix in TEXT and "__pycache__" not in f.parts:
                yield f


def test_no_file_names_a_path_outside_the_checkout():
    this = Path(__file__).resolve()
    hits = []
    for f in product_files():
        if f.resolve() == this:
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{f.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def _strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def test_config_paths_stay_inside_the_checkout():
    """Every path-like value of every YAML config is relative and stays inside the checkout: an output under runs/
    or data_cache/, another config of the repository (relative to the file that names it), or an asset name."""
    bad = []
    for f in sorted((REPO / "configs").rglob("*.yaml")):
        for value in _strings(yaml.safe_load(f.read_text(encoding="utf-8"))):
            if value.startswith("asset:") or "/" not in value or " " in value:
                continue
            target = (f.parent / value).resolve()
            include = target.is_relative_to(REPO.resolve()) and target.is_file()  # e.g. ../models/tiny_hybrid.yaml
            if value.startswith(("/", "~")) or (".." in Path(value).parts and not include):
                bad.append(f"{f.relative_to(REPO)}: {value}")
    assert not bad, "\n".join(bad)
