"""The installed wheel holds the toolkit and nothing else: no benchmark, probe, experiment or test module.

The wheel is built from a copy of the checkout in a temporary folder (setuptools writes build/ and *.egg-info beside
the sources it builds), offline: ``pip wheel --no-deps --no-build-isolation --no-index`` with the environment's own
setuptools."""
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from conftest import REPO

# what a checkout has that a build never reads (and that is large or machine-local)
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", ".device", ".pytest_cache", ".whl", "__pycache__", "*.pyc",
                                    "build", "dist", "*.egg-info", "data_cache", "runs", "docs")
TOOLKIT = ("hybridlm/__init__.py", "hybridlm/model/modeling.py", "hybridlm/training/__init__.py",
           "pretrain/__init__.py", "pretrain/cli.py", "upcycle/__init__.py", "upcycle/cli.py", "distill/__init__.py",
           "distill/kd.py", "smart_select/__init__.py", "smart_select/selection.py")
# a folder that holds research code, not the toolkit (a module may be named so: hybridlm/eval/harness.py runs
# lm-evaluation-harness)
RESEARCH_FOLDERS = {"bench", "benchmark", "benchmarks", "probe", "probes", "test", "tests", "harness", "experiment",
                    "experiments"}
# the research modules that once lived inside the installed packages, and the names such modules take
MOVED = {"train_speed", "legacy_init", "init_variants", "ild_proxy", "measure_init", "fla_interpret", "loss_parity",
         "kernel_compile", "trace_gaps", "saved_activations", "profile_step", "peers"}
RESEARCH_STEM = re.compile(r"^(peer|bench|probe|test)_|_(probe|bench)$|^conftest$")


def _research(name: str) -> bool:
    path = PurePosixPath(name)
    return (any(p in RESEARCH_FOLDERS for p in path.parts[:-1]) or path.stem in MOVED
            or bool(RESEARCH_STEM.search(path.stem)))


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "out"
    shutil.copytree(REPO, src, ignore=NOT_COPIED)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                          cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = sorted(out.glob("hybrid_lm_toolkit-*.whl"))
    assert len(wheels) == 1, sorted(p.name for p in out.iterdir())
    with zipfile.ZipFile(wheels[0]) as z:
        return sorted(z.namelist())


def _package_files(names):
    """The wheel's files outside its .dist-info folder."""
    return [n for n in names if not PurePosixPath(n).parts[0].endswith(".dist-info")]


def test_the_wheel_holds_the_toolkit(wheel_files):
    missing = [f for f in TOOLKIT if f not in wheel_files]
    assert not missing, f"toolkit files missing from the wheel: {missing}"
    tops = {PurePosixPath(n).parts[0] for n in _package_files(wheel_files)}
    assert tops == {"hybridlm", "pretrain", "upcycle", "distill", "smart_select"}, sorted(tops)


def test_the_wheel_holds_no_research_code(wheel_files):
    bad = [n for n in _package_files(wheel_files) if _research(n)]
    assert not bad, ("benchmark / probe / test modules in the wheel (they belong in benchmarks/ or tests/):\n"
                     + "\n".join(bad))


def test_the_check_sees_a_research_module():
    # the layout before benchmarks/ held the harness fails the check above, module by module
    for name in ("hybridlm/bench/loss_parity.py", "hybridlm/bench/__init__.py", "pretrain/train_speed.py",
                 "hybridlm/model/legacy_init.py", "upcycle/init_variants.py", "upcycle/ild_proxy.py",
                 "upcycle/measure_init.py", "hybridlm/bench/peer_ssd.py", "benchmarks/harness/flops.py",
                 "tests/support/fla_interpret.py"):
        assert _research(name), name
    for name in ("hybridlm/eval/harness.py", "hybridlm/model/generate.py", "pretrain/train.py"):
        assert not _research(name), name
