"""What a user reads: the README fits on a few screens, BENCHMARKS.md states current figures and cites only raw
files that exist, docs/results holds only what BENCHMARKS.md cites, and the product speaks of itself and its users
(no development history: numbered work sessions, tool calls, borrowed machines)."""
import re

from conftest import REPO

HISTORY = re.compile(r"\bsessions? \d|\bsession\b(?! ?=)|\bcall \d|device machine|\blent\b|\bhelper|\bthe seed\b|"
                     r"\bthe issue\b", re.IGNORECASE)
# ordinary senses that the pattern above would otherwise match
ORDINARY = re.compile(r"scope=\"session\"|pytest session|tmux session|requests\.Session|Session\(", re.IGNORECASE)
PLACES = ("README.md", "BENCHMARKS.md", "docs", "configs", "scripts", "benchmarks", "hybridlm", "pretrain", "upcycle",
          "distill", "smart_select", "pyproject.toml", "pretrain.py", ".ci")
TEXT = {".py", ".sh", ".yaml", ".md", ".toml", ""}


def _files():
    for name in PLACES:
        root = REPO / name
        for f in ([root] if root.is_file() else sorted(root.rglob("*"))):
            if (f.is_file() and f.suffix in TEXT and "__pycache__" not in f.parts
                    and "results" not in f.relative_to(REPO).parts):
                yield f


def test_no_development_history_in_the_product():
    hits = []
    for f in _files():
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if HISTORY.search(ORDINARY.sub("", line)):
                hits.append(f"{f.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


def test_readme_and_benchmarks_stay_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
    assert len((REPO / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()) <= 700


def test_results_folder_holds_exactly_what_benchmarks_cites():
    text = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"docs/results/[\w./+-]*\w", text))
    missing = sorted(c for c in cited if not (REPO / c).exists())
    assert not missing, f"BENCHMARKS.md cites files that do not exist: {missing}"
    kept = {str(f.relative_to(REPO)) for f in (REPO / "docs" / "results").rglob("*") if f.is_file()}
    uncited = sorted(k for k in kept if not any(k == c or k.startswith(c.rstrip("/") + "/") for c in cited))
    assert not uncited, f"docs/results files no table cites: {uncited}"


# a figure in milliseconds or microseconds (``12 ms``, ``0.5us``): measured on one GPU, it belongs in BENCHMARKS.md
TIMING = re.compile(r"[0-9][0-9.]* ?(ms|µs|us)\b")


def test_no_timing_figures_in_the_toolkit_comments():
    """The toolkit's comments state what is slow and why, and name the BENCHMARKS.md section that holds the figure."""
    hits = []
    for f in sorted((REPO / "hybridlm").rglob("*.py")):
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if TIMING.search(line):
                hits.append(f"{f.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not hits, "timing figures (BENCHMARKS.md holds them):\n" + "\n".join(hits)
