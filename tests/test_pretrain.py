"""The pre-training job as a user runs it: real data, real tokenizer, real DeepSpeed on CPU.

Every run here is a subprocess of ``pretrain.py``; faults (SIGKILL, NaN losses) are real, injected
through hybridlm.utils.faults.
"""
import hashlib
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_MODEL, subprocess_env, assert_chart





def run_pretrain(out_dir, data, *extra, env=None, nproc=1, check=True, timeout=600):
    args = ["--config", "configs/experiments/default_cpu.yaml", f"data.path={data}", "data.sources=[]",
            "data.seq_len=32", "data.val_max_batches=2", "optim.micro_batch_size=2", "optim.global_batch_size=4",
            "optim.warmup_steps=2", "optim.max_steps=8", f"run.output_dir={out_dir}", "run.eval_interval=4",
            "run.save_interval=3", "run.sample_tokens=4", "run.progress=false", *TINY_MODEL, *extra]
    full_env = subprocess_env(**(env or {}))
    if nproc == 1:
        cmd = [sys.executable, "pretrain.py", *args]
    else:
        from hybridlm.engine import free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "pretrain.py", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(out_dir):
    rows = [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def strict_json(text):
    """json.loads refusing NaN / Infinity: what the project writes must be standard JSON."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, austen_data):
    """One uninterrupted 8-step run: checked in full below, and the reference the killed-and-resumed run must
    reproduce."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return out, run_pretrain(out, austen_data)


def test_run_writes_logs_checkpoints_export_and_sample(straight, austen_data):
    out, proc = straight
    result = strict_json((out / "result.json").read_text())
    assert strict_json(proc.stdout.strip().splitlines()[-1]) == result
    assert result["steps"] == 8 and result["skipped_steps"] == 0
    train = losses(out)
    assert sorted(train) == list(range(1, 9))
    # it learns: validation at step 8 below validation at step 4 and below the first step's loss (ln 128256
    # = 11.76 is where an untrained model starts)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [round(math.log(r["val_ppl"]), 6) for r in rows if "val_loss" in r] == [round(v, 6) for v in val]
    assert len(val) == 2 and val[1] < val[0] - 0.05 and result["val_loss"] == val[1] < train[1] - 0.1
    prompt = "It is a truth universally acknowledged"
    assert result["sample"].startswith(prompt) and len(result["sample"]) > len(prompt)  # new text after the prompt
    settings = "top-k 50, temperature 0.8, seed 0, no repeated 3-grams; 8 steps of training, expect rough text"
    assert result["sample_settings"] == settings and f"sample ({settings}): " in proc.stdout
    assert_chart(out / "loss_curve.png")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 9))
    assert [round(e.value, 4) for e in events.Scalars("val_loss")] == [round(v, 4) for v in val]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_6", "step_8"]  # keep_last 2
    from transformers import AutoModelForCausalLM
    import hybridlm.model  # noqa: F401  (registers the classes)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.layer_plan[0] == "mla" and (out / "final" / "tokenizer.json").is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".final")]  # the export's temp folder renamed
    # the same command again: the run is complete, nothing trains, the recorded figures stay as they are
    recorded, ckpt_files = (out / "result.json").read_text(), sorted(p.name for p in (out / "checkpoints").iterdir())
    again = run_pretrain(out, austen_data)
    assert "run already complete" in again.stdout and "resumed from" not in again.stdout
    assert (out / "result.json").read_text() == recorded and losses(out) == train
    assert strict_json(again.stdout.strip().splitlines()[-1]) == result
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ckpt_files


def test_resume_refuses_a_planted_pickle_with_one_error_line(tmp_path, austen_data, straight):
    """A crafted checkpoint in an output directory (run.resume is on by default) is refused, not run."""
    import shutil

    out = tmp_path / "planted"
    shutil.copytree(straight[0], out)
    marker = tmp_path / "code_ran"
    step = (out / "checkpoints" / "latest").read_text().strip()
    payload = ("import pickle, os\n"
               "class P:\n    def __reduce__(self):\n"
               f"        return (os.system, ('touch {marker}',))\n"
               f"path = {str(out / 'checkpoints' / step / 'rng_state_rank00000.pt')!r}\n"
               "pickle.dump({'python': P()}, open(path, 'wb'))\n")
    subprocess.run([sys.executable, "-c", payload], check=True)
    manifest_path = out / "checkpoints" / step / "manifest.json"  # a crafted folder fixes the sizes too
    manifest = json.loads(manifest_path.read_text())
    planted = out / "checkpoints" / step / "rng_state_rank00000.pt"
    manifest["files"]["rng_state_rank00000.pt"] = planted.stat().st_size
    manifest["sha256"]["rng_state_rank00000.pt"] = hashlib.sha256(planted.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    proc = run_pretrain(out, austen_data, "optim.max_steps=10", check=False)  # continue the run: a resume
    assert proc.returncode == 2 and not marker.exists()
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("error: ") and "rng_state_rank00000.pt" in err[-1], err[-3:]
    assert "a pickle can run code" in err[-1]
    assert "Traceback" not in proc.stderr


def test_killed_in_a_save_then_preempted_resumes_bitwise_twice(tmp_path, austen_data, straight):
    """One run stopped twice, as a cluster would: SIGKILLed in the middle of the step-6 checkpoint save (the
    step-3 one must survive), then, resumed, pre-empted by SIGTERM after step 7 (it saves and exits 143); the
    third launch finishes it with every step's loss equal to the uninterrupted run's, bit for bit."""
    out = tmp_path / "twice"
    killed = run_pretrain(out, austen_data, env={"HYBRIDLM_FAULT_KILL_IN": "save:6"}, check=False)
    assert killed.returncode == -signal.SIGKILL
    ck = out / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_3" and not (ck / "step_6").exists()
    assert (ck / ".tmp_step_6").is_dir()  # the save that died, never committed
    assert max(losses(out)) == 6  # it trained past the surviving checkpoint before it died

    stopped = run_pretrain(out, austen_data, env={"HYBRIDLM_FAULT_TERM_AT_STEP": "7"}, check=False)
    assert stopped.returncode == 143 and "Traceback" not in stopped.stderr
    assert "resumed from" in stopped.stdout and "at step 3" in stopped.stdout
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: stopped by SIGTERM at step 7 of 8") and "rerun to resume" in last
    assert (ck / "step_7").is_dir() and not (out / "final").exists()  # saved, not exported
    assert not (ck / ".tmp_step_6").exists()  # cleared by the step-6 save of the resumed run

    finished = run_pretrain(out, austen_data)
    assert "resumed from" in finished.stdout and "at step 7" in finished.stdout
    assert losses(out) == losses(straight[0])  # exact float equality, every step


def test_kill_during_the_export_leaves_no_final_and_the_rerun_exports(tmp_path, austen_data):
    out = tmp_path / "killed_in_export"
    killed = run_pretrain(out, austen_data, env={"HYBRIDLM_FAULT_KILL_IN": "export"}, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert not (out / "final").exists() and not (out / "result.json").exists()  # absent, not half-written
    assert len(list(out.glob(".final.tmp-*"))) == 1  # what the killed export had written
    rerun = run_pretrain(out, austen_data)
    assert "resumed from" in rerun.stdout and not list(out.glob(".final.tmp-*"))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import hybridlm.model  # noqa: F401  (registers the model type)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert AutoTokenizer.from_pretrained(out / "final").vocab_size > 0
    assert sum(p.numel() for p in model.parameters()) > 0
    assert json.loads((out / "result.json").read_text())["steps"] == 8


def test_nan_steps_are_skipped_then_the_run_stops_with_a_checkpoint(tmp_path, austen_data):
    out = tmp_path / "nan"
    run_pretrain(out, austen_data, "optim.max_steps=4", env={"HYBRIDLM_FAULT_NAN_AT_STEPS": "2"})
    result = strict_json((out / "result.json").read_text())
    assert result["skipped_steps"] == 1 and result["steps"] == 4
    assert losses(out)[2] is None and all(losses(out)[k] > 0 for k in (1, 3, 4))  # the skipped step's NaN: null
    bad = run_pretrain(tmp_path / "nan2", austen_data, "optim.max_consecutive_nonfinite=2", "run.save_interval=0",
                       "optim.max_steps=4", env={"HYBRIDLM_FAULT_NAN_AT_STEPS": "2,3,4"}, check=False)
    assert bad.returncode == 3 and "Traceback" not in bad.stderr  # a message, not a crash
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "non-finite" in last.lower() and "checkpoint saved" in last
    assert (tmp_path / "nan2" / "checkpoints" / "step_3").is_dir()


def test_a_two_rank_run_resumes_on_one_rank(tmp_path, austen_data, straight):
    """Pre-empted on 2 ranks, rescheduled on 1: the run resumes at its checkpoint with the optimizer state
    re-partitioned and the data position kept, so every step's loss is the uninterrupted run's (to float rounding
    of the gradient sums: one rank accumulates two micro-batches where two ranks average theirs)."""
    out = tmp_path / "elastic"
    want = losses(straight[0])

    def close_to_one_rank(got):
        for step in got:
            assert abs(got[step] - want[step]) < 1e-4 * abs(want[step]), (step, got[step], want[step])

    killed = run_pretrain(out, austen_data, env={"HYBRIDLM_FAULT_KILL_AT_STEP": "5"}, nproc=2, check=False)
    assert killed.returncode != 0 and (out / "checkpoints" / "step_3").is_dir()
    two_ranks = losses(out)
    assert set(range(1, 5)) <= set(two_ranks)  # (step 5's row races the launcher tearing rank 0 down)
    close_to_one_rank(two_ranks)  # two ranks train as one rank does
    resumed = run_pretrain(out, austen_data)  # one rank now
    assert "at step 3" in resumed.stdout
    assert sorted(losses(out)) == list(range(1, 9))
    close_to_one_rank(losses(out))


@pytest.mark.parametrize("override,message", [
    (["data.path=/nonexistent/data"], "error: data.path: /nonexistent/data/meta.json does not exist"),
    (["optim.global_batch_size=3"], "error: optim.global_batch_size: 3 is not a multiple of micro_batch_size=2"),
    (["optim.lrr=1"], "error: optim: unknown key 'lrr'"),
    (["model.hybrid_override_pattern=*-Q-"], "error: hybrid_override_pattern: unknown symbol 'Q'"),
    (["run.output_dir="], "error: run.output_dir: expected a directory path"),
])
def test_bad_input_is_one_clear_line(tmp_path, austen_data, override, message):
    proc = run_pretrain(tmp_path / "bad", austen_data, *override, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-500:]


def test_truncated_shard_is_named(tmp_path, austen_data):
    import shutil
    data = tmp_path / "data"
    shutil.copytree(austen_data, data)
    shard = next((data / "train").glob("*.bin"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 7)
    proc = run_pretrain(tmp_path / "bad", data, check=False)
    assert proc.returncode == 2 and shard.name in proc.stderr.strip().splitlines()[-1]
    # garbage of the right size: its sha256 is not the one meta.json records; named before training, no traceback
    shard.write_bytes(b"\xff" * (shard.stat().st_size + 7))
    proc = run_pretrain(tmp_path / "bad2", data, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-800:]
    assert last.startswith(f"error: {shard}") and "sha256" in last


def test_time_budget_stops_early_with_checkpoint_and_export(tmp_path, austen_data):
    # run.max_minutes=1e-6: the budget counts from the end of the first step (its compilation and autotuning
    # are not training time), so it is spent after the second, which is then saved and exported
    proc = run_pretrain(tmp_path / "run", austen_data, "optim.max_steps=50", "run.max_minutes=1e-6")
    assert "run.max_minutes=1e-06 reached at step 2 of 50" in proc.stdout
    assert list(losses(tmp_path / "run")) == [1, 2]
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
