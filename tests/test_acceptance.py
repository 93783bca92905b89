"""benchmarks/acceptance.sh and its runner (benchmarks/acceptance.py) on a CPU: the help, the one-line refusal without
CUDA, and the report the runner writes, checked against its schema, from parts that pass, fail, run past their limit
and fail to start."""
import json
import subprocess
import sys
import time

import pytest

from benchmarks import acceptance as A
from conftest import REPO, subprocess_env


def test_help_names_every_part():
    out = subprocess.run(["bash", "benchmarks/acceptance.sh", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for part in A.PARTS:
        assert f"  {part} " in out.stdout, part
    assert "OUT_DIR/acceptance.json" in out.stdout and A.SCHEMA in out.stdout


def test_without_cuda_one_line_and_exit_2(tmp_path):
    out = subprocess.run(["bash", "benchmarks/acceptance.sh", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("error: benchmarks/acceptance.sh needs a CUDA GPU: torch.cuda.is_available() is False")


def test_the_report_and_summary_of_passing_failing_and_stopped_parts(tmp_path):
    py = sys.executable
    parts = [
        A.Part("pretrain", [py, "-c", "print('step 1 loss 9.5'); print('first step done in 12.5 s (compilation and "
                                      "autotuning included; shipped tuning served 22 autotuned kernels, 0 tuned "
                                      "afresh)'); print('step 30 loss 6.25')"], 60, read=A._first_step),
        A.Part("route", [py, "-c", "import sys; print('route: stage 1/8 init'); print('first step done in 2.8 s "
                                   "(shipped tuning served 4 autotuned kernels, 6 tuned afresh)'); print('first step "
                                   "done in 19.1 s (shipped tuning served 14 autotuned kernels, 10 tuned afresh)'); "
                                   "sys.exit(3)"], 60, read=A._route_stages),
        A.Part("generate", [py, "-c", "import time; time.sleep(30)"], 1),
        A.Part("gpu_tests", [py, "-c", "pass"], 60, before=lambda out: 1 / 0),
    ]
    t0 = time.monotonic()
    report = A.new_report(A.host_facts(), "kernel tuning: none shipped for CPU")
    for part in parts:
        report["parts"].append(A.run_part(part, tmp_path))
        A.finish(report, t0, len(parts))
        A.check_report(report)
    json.loads(json.dumps(report))  # plain JSON
    got = {p["name"]: p for p in report["parts"]}
    assert not report["passed"] and report["first_step_seconds"] == 12.5
    assert got["pretrain"]["passed"] and got["pretrain"]["counts"] == {"first_step_seconds": 12.5, "last_step": 30,
                                                                      "last_loss": 6.25, "tuned_afresh": 0}
    assert (got["route"]["passed"], got["route"]["exit_code"], got["route"]["counts"]["stages"]) == (False, 3, ["init"])
    assert got["route"]["counts"]["tuned_afresh"] == 16 and got["route"]["summary"].endswith("16 launches tuned afresh")
    assert got["generate"]["exit_code"] == 124 and got["generate"]["summary"].startswith("stopped at its limit of 1 s")
    assert got["gpu_tests"]["exit_code"] == 125
    assert "ZeroDivisionError" in (tmp_path / "gpu_tests.log").read_text()
    for p in report["parts"]:
        assert (tmp_path / p["log"]).is_file()
    text = A.summary(report)
    assert text.splitlines()[0].startswith("acceptance: FAILED in ") and "GDN-300M's first optimizer step: 12.5 s" in text
    assert len(text.splitlines()) == 2 + len(parts) + 1


def test_a_report_missing_a_field_is_refused():
    report = A.new_report(A.host_facts(), "t")
    A.check_report(report)
    for key in ("passed", "host", "parts"):
        broken = dict(report)
        del broken[key]
        with pytest.raises(ValueError, match=repr(key)):
            A.check_report(broken)
    with pytest.raises(ValueError, match=r"parts\[0\]\.seconds"):
        A.check_report(dict(report, parts=[{"name": "x", "passed": True}]))


def test_every_part_is_a_command_the_checkout_has(tmp_path):
    """The parts' commands name files and configs that exist (nothing runs)."""
    table = A.parts(tmp_path, tmp_path / "data")
    assert list(table) == list(A.PARTS)
    for part in table.values():
        for arg in part.argv:
            if arg.endswith((".py", ".yaml")) and not arg.startswith("-"):
                assert (REPO / arg).is_file(), (part.name, arg)


def test_the_gpu_subset_is_collected_and_covers_every_gpu_test_function():
    """The gpu_tests part's node ids are tests the `gpu` suite collects (on a CPU too: the ids are the same), and
    every gpu test function runs in it at least once or is left to the whole suite with its reason."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "tests"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=subprocess_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert len(collected) > 100, out.stdout[-2000:]
    assert len(set(A.GPU_SUBSET)) == len(A.GPU_SUBSET)
    assert not [i for i in A.GPU_SUBSET if i not in collected], "not collected by -m gpu"
    functions = {i.split("[")[0] for i in collected}
    chosen = {i.split("[")[0] for i in A.GPU_SUBSET}
    assert not chosen & set(A.GPU_SUBSET_LEAVES), "a function both run and left out"
    assert functions == chosen | set(A.GPU_SUBSET_LEAVES), sorted(functions ^ (chosen | set(A.GPU_SUBSET_LEAVES)))
    assert len(A.GPU_SUBSET) < len(collected) / 3


def test_the_report_names_the_commit_of_the_tree_or_says_why_not(tmp_path):
    """A commit given wins; else HEAD where the tracked files equal it; a tree that differs from its HEAD (local
    changes, or another checkout's git metadata) has none, with the reason."""
    assert A.tree_commit("abc1234") == ("abc1234", "given (--commit / HYBRIDLM_COMMIT)")
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    real = A.REPO
    try:
        A.REPO = repo
        assert A.tree_commit() == (sha, "git rev-parse HEAD (the tracked files equal HEAD's)")
        (repo / "untracked.txt").write_text("made by a run\n")
        assert A.tree_commit()[0] == sha
        (repo / "a.py").write_text("x = 2\n")  # the code that ran is not HEAD's
        commit, why = A.tree_commit()
        assert commit is None and why.startswith(f"unknown: the tree differs from HEAD {sha[:12]} in 1 tracked files")
        report = A.new_report(A.host_facts(), "t")
        A.check_report(report)
        assert report["commit"] is None and report["commit_source"] == why
        assert A.new_report(A.host_facts(), "t", commit="f00d")["commit"] == "f00d"
        A.REPO = tmp_path / "no-git"
        A.REPO.mkdir()
        assert A.tree_commit() == (None, "unknown: no git history here (pass --commit or HYBRIDLM_COMMIT)")
    finally:
        A.REPO = real
