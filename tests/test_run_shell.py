"""The run shell (hybridlm/training/shell.py) around pre-training, every distillation stage and the route: one process
per run directory for the stages and the route too (exit 4, one line naming the holder), SIGTERM at any phase of a
run (start-up, inside a load, the last step, the export) ends in one ``stopped:`` line and exit 143 with nothing
lost, a kill at a commit instant of a stage's export resumes to a complete stage, and a stage is finished only when
its export verifies."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, demo_file, save_tiny_llama, subprocess_env
from hybridlm.training.lock import RunLock
from hybridlm.utils.atomic import verify_complete_directory
from test_fault_campaign import pretrain


@pytest.fixture(scope="module")
def students(tmp_path_factory):
    """A tiny teacher and its two initialised students."""
    root = tmp_path_factory.mktemp("students")
    teacher = save_tiny_llama(root / "teacher", num_layers=2)
    init = subprocess.run([sys.executable, "-m", "upcycle.cli", "init", "--teacher", str(teacher), "--out",
                           str(root / "init"), "--kv-lora-rank", "32", "--qk-rope-head-dim", "8", "--calib-tokens", "0"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-2000:]
    return teacher, root / "init"


def ild_argv(teacher, student, out, data, *extra):
    return [sys.executable, "-m", "upcycle.cli", "ild", "--config", "configs/upcycle/smollm2_ild_cpu.yaml",
            f"teacher.path={teacher}", f"student.path={student}", f"data.path={data}",
            f"data.sources=[{demo_file('alpaca_en_demo.json')}]", "data.seq_len=32", "data.val_max_batches=1",
            "optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=2", f"run.output_dir={out}",
            "run.eval_interval=0", "run.save_interval=1", "run.progress=false", *extra]


def stage_argv(stage, teacher, init, out, tmp_path):
    """A command of each stage and of the route on ``out`` (each would train; here it meets a held lock first)."""
    if stage == "ild":
        return ild_argv(teacher, init / "mla_student", out, tmp_path / "data")
    if stage == "kd":
        return [sys.executable, "-m", "upcycle.cli", "kd", "--config", "configs/upcycle/smollm2_kd_cpu.yaml",
                f"teacher.path={teacher}", f"student.path={init / 'mla_student'}", f"run.output_dir={out}"]
    if stage == "dpo":
        return [sys.executable, "-m", "upcycle.cli", "dpo", "--config", "configs/upcycle/smollm2_dpo_cpu.yaml",
                f"student.path={init / 'mla_student'}", f"run.output_dir={out}"]
    return [sys.executable, "-m", "upcycle.cli", "run", "--config", "configs/upcycle/smollm2_route_cpu.yaml",
            f"output_dir={out}", f"teacher={teacher}", f"ild.data.path={tmp_path / 'data'}"]


@pytest.mark.parametrize("stage", ["ild", "kd", "dpo", "run"])
def test_a_second_process_on_a_stage_or_route_directory_is_refused(tmp_path, students, stage):
    teacher, init = students
    out = tmp_path / "out"
    holder = RunLock(out).acquire()  # a live holder: this process
    try:
        proc = subprocess.run(stage_argv(stage, teacher, init, out, tmp_path), cwd=REPO, env=subprocess_env(),
                              capture_output=True, text=True, timeout=300)
    finally:
        holder.release()
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert err[-1].startswith("error: ") and f"in use by process {os.getpid()}" in err[-1], err[-1]
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
def test_the_route_holds_its_directory_and_resumes_after_a_kill(tmp_path, students):
    """A route frozen in its first training stage (SIGSTOP after step 1, saved) holds its output_dir: a stage command
    on a folder inside it is refused naming the route's pid. Killed there, the same command resumes that stage from
    its checkpoint and finishes every stage."""
    teacher, init = students
    route_out = tmp_path / "route"
    small = ["optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=2", "optim.warmup_steps=1",
             "run.progress=false", "run.eval_interval=0", "run.save_interval=1", "data.val_max_batches=1"]
    argv = stage_argv("run", teacher, init, route_out, tmp_path) + [
        "init.kv_lora_rank=32", "init.qk_rope_head_dim=8", "init.calib_tokens=512", "init.calib_seq_len=64",
        "ild.data.sources=[asset:alpaca_en_demo]", "ild.data.seq_len=32", "smart.n_mla=2", "smart.batches=1",
        "smart.batch_size=2", "kd.data.path=asset:alpaca_en_demo", "kd.data.max_length=64",
        "dpo.data.path=asset:dpo_en_demo", "dpo.data.max_length=64", "dpo.data.max_prompt_length=32",
        "report.seq_len=32", "report.max_tokens=256", "report.generation_prompts=0",
        *[f"{stage}.{o}" for stage in ("ild", "kd", "dpo") for o in small]]
    route = subprocess.Popen(argv, cwd=REPO, env=subprocess_env(HYBRIDLM_FAULT_STOP_AT_STEP="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and route.poll() is None:
            state = open(f"/proc/{route.pid}/stat").read().split(")")[-1].split()[0]
            if state == "T":  # stopped at step 1 of its first ILD run
                break
            time.sleep(1)
        assert route.poll() is None, route.communicate()[1][-3000:]
        proc = subprocess.run(stage_argv("kd", teacher, init, route_out / "kd", tmp_path), cwd=REPO,
                              env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 4, proc.stderr[-2000:]
        assert f"in use by process {route.pid}" in proc.stderr.strip().splitlines()[-1]
    finally:
        route.kill()
        route.wait()
    again = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and (route_out / "route.json").is_file()
    for stage in ("ild_mla", "kd", "dpo"):
        assert json.loads((route_out / stage / "final" / "stage.json").read_text())["steps"] == 2, stage


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
@pytest.mark.parametrize("phase,env,steps", [
    ("startup", {"HYBRIDLM_FAULT_TERM_IN": "startup"}, 0),
    ("last step", {"HYBRIDLM_FAULT_TERM_AT_STEP": "4"}, 4),
    ("export", {"HYBRIDLM_FAULT_TERM_IN": "export"}, 4),
])
def test_sigterm_at_any_phase_stops_with_143_and_a_rerun_goes_on(tmp_path, austen_data, phase, env, steps):
    out = tmp_path / "run"
    first = pretrain(out, austen_data, env=env)
    err = first.stderr.strip().splitlines()
    assert first.returncode == 143, (phase, first.returncode, first.stderr[-3000:])
    assert err[-1].startswith("stopped: stopped by SIGTERM") and "Traceback" not in first.stderr, first.stderr[-2000:]
    trained = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(l)] if (out / "metrics.jsonl").exists() else []
    assert max(trained, default=0) == steps
    if steps:  # a signal in the last step or the export waits until the export and the result are complete
        assert (out / "final" / ".complete").exists() and (out / "result.json").is_file()
    again = pretrain(out, austen_data)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "result.json").read_text())["steps"] == 4
    assert ("run already complete" in again.stdout) == (phase != "startup")


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
@pytest.mark.parametrize("instant", ["save-committed:1", "save-latest:1", "export-written", "export-placed",
                                     "export-done"])
def test_a_kill_in_a_stage_export_resumes_to_a_complete_stage(tmp_path, students, instant):
    teacher, init = students
    out = tmp_path / "ild"
    argv = ild_argv(teacher, init / "mla_student", out, tmp_path / "data")
    first = subprocess.run(argv, cwd=REPO, env=subprocess_env(HYBRIDLM_FAULT_KILL_IN=instant), capture_output=True,
                           text=True, timeout=600)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert not (out / "final" / "stage.json").exists() or (out / "final" / ".complete").exists()
    if instant.startswith("save"):  # killed in its step-1 save: the rerun resumes from a complete checkpoint
        assert not (out / "final").exists()
    again = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "final" / "stage.json").read_text())["steps"] == 2
    assert (out / "final" / ".complete").exists() and (out / "final" / "config.json").is_file()
    assert not list(out.glob("final.*")) and not list(out.glob(".final*"))  # no temporaries left


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
def test_a_full_disk_at_the_latest_pointer_is_one_line_and_leaves_nothing_unnamed(tmp_path, austen_data):
    out = tmp_path / "run"
    first = pretrain(out, austen_data, env={"HYBRIDLM_FAULT_DISK_FULL_IN": "save-latest:2"})
    err = first.stderr.strip().splitlines()
    assert first.returncode == 4 and "Traceback" not in first.stderr, first.stderr[-2000:]
    assert err[-1].startswith("error: ") and "step 2" in err[-1], err[-1]
    assert not (out / "checkpoints" / "step_2").exists() and not (out / "checkpoints" / "latest").exists()
    again = pretrain(out, austen_data)
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
@pytest.mark.parametrize("pointer", ["bytes", "directory"])
def test_a_damaged_latest_pointer_is_one_line(tmp_path, austen_data, pointer):
    out = tmp_path / "run"
    assert pretrain(out, austen_data, "optim.max_steps=2").returncode == 0
    latest = out / "checkpoints" / "latest"
    latest.unlink()
    if pointer == "bytes":
        latest.write_bytes(b"\xff\xfe\x80step_2\n")
    else:
        latest.mkdir()
    again = pretrain(out, austen_data)  # optim.max_steps=4: a resume, which reads the pointer
    err = again.stderr.strip().splitlines()
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert err[-1].startswith(f"error: checkpoint {latest}: "), err[-1]
    assert max(json.loads(l).get("step", 0) for l in (out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
def test_a_seed_past_64_bits_is_one_line(tmp_path, austen_data):
    proc = pretrain(tmp_path / "run", austen_data, f"optim.seed={2**64}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: optim.seed: "), proc.stderr[-500:]


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
def test_a_signal_inside_a_load_is_reported_as_a_stop_not_a_bad_input(tmp_path, students):
    """SIGTERM inside the student's load, whose `except` turns failures into `student.path: cannot be loaded`:
    the load completes, the stage stops right after it."""
    teacher, init = students
    argv = ild_argv(teacher, init / "mla_student", tmp_path / "ild", tmp_path / "data")
    proc = subprocess.run(argv, cwd=REPO, env=subprocess_env(HYBRIDLM_FAULT_TERM_IN="load"), capture_output=True,
                          text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("stopped: stopped by SIGTERM after the ild stage's student was loaded"), lines[-1]
    assert not [ln for ln in lines if ln.startswith("error:")] and not (tmp_path / "ild" / "final").exists()


@pytest.mark.slow  # with the CPU `slow` tests (.ci/run): the default run stays under 20 minutes
def test_a_stage_is_finished_only_when_its_export_verifies(tmp_path, students):
    """Killed with final/ complete and its checkpoints not yet removed, then its weights truncated: the rerun redoes
    the export from the last checkpoint. With final/.complete removed and no checkpoint left: one line, exit 2."""
    teacher, init = students
    out = tmp_path / "ild"
    argv = ild_argv(teacher, init / "mla_student", out, tmp_path / "data")
    first = subprocess.run(argv, cwd=REPO, env=subprocess_env(HYBRIDLM_FAULT_KILL_IN="export-done"),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == -signal.SIGKILL and (out / "checkpoints" / "latest").is_file(), first.stderr[-2000:]
    weights = out / "final" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    again = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "already finished" not in again.stdout, again.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints'} at step 2" in again.stdout
    assert verify_complete_directory(out / "final") is None and not (out / "checkpoints").exists()
    (out / "final" / ".complete").unlink()
    refused = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and len(lines) == 1, refused.stderr[-2000:]
    assert lines[0].startswith(f"error: run.output_dir: {out / 'final'} is not a verified export"), lines[0]
    assert "no checkpoint is left" in lines[0] and (out / "final" / "model.safetensors").is_file()
