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
        A.Part("pretrain", [py, "-c", "print('step 1 loss 9.5'); print('first step done in 12.5 s'); "
                                      "print('step 30 loss 6.25')"], 60, read=A._first_step),
        A.Part("route", [py, "-c", "import sys; print('route: stage 1/8 init'); sys.exit(3)"], 60,
               read=A._route_stages),
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
                                                                      "last_loss": 6.25}
    assert (got["route"]["passed"], got["route"]["exit_code"], got["route"]["counts"]["stages"]) == (False, 3, ["init"])
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
