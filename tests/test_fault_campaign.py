"""Fault campaign: a run survives a kill at every commit instant, one process per run directory, corrupted bytes
are refused by name, a changed schedule on resume is applied and stated, and bad input is one ``error:`` line.

Kills are real SIGKILLs at named instants (hybridlm/utils/faults.py: ``HYBRIDLM_FAULT_KILL_IN``), a full disk is
an ENOSPC raised at a named instant (``HYBRIDLM_FAULT_DISK_FULL_IN``); nothing waits on the machine's speed.
"""
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, TINY_MODEL, subprocess_env
from hybridlm.config.errors import ConfigError


_spec = importlib.util.spec_from_file_location("engine_worker", os.path.join(REPO, "tests", "engine_worker.py"))
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def pretrain_argv(out_dir, data, *extra):
    """4 steps, a checkpoint and a validation every 2, the export; no sample, no TensorBoard (time)."""
    return [sys.executable, "pretrain.py", "--config", "configs/experiments/default_cpu.yaml", f"data.path={data}",
            "data.sources=[]", "data.seq_len=32", "data.val_max_batches=2", "optim.micro_batch_size=2",
            "optim.global_batch_size=4", "optim.warmup_steps=2", "optim.max_steps=4", f"run.output_dir={out_dir}",
            "run.eval_interval=2", "run.save_interval=2", "run.sample_tokens=0", "run.progress=false",
            "run.tensorboard=false", *TINY_MODEL, *extra]


def pretrain(out_dir, data, *extra, env=None):
    return subprocess.run(pretrain_argv(out_dir, data, *extra), cwd=REPO, env=subprocess_env(**(env or {})),
                          capture_output=True, text=True, timeout=600)


def run_all(commands, limit=3):
    """Run ``name: (argv, env)`` at most ``limit`` at a time; ``name: CompletedProcess``."""
    pending, running, done = list(commands.items()), {}, {}
    while pending or running:
        while pending and len(running) < limit:
            name, (argv, env) = pending.pop(0)
            running[name] = subprocess.Popen(argv, cwd=REPO, env=subprocess_env(**(env or {})),
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        name = next(iter(running))
        proc = running.pop(name)
        out, err = proc.communicate(timeout=600)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def rows(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(out_dir):
    return {r["step"]: r["loss"] for r in rows(out_dir) if "loss" in r}


def one_error_line(proc, status, *needles):
    """The run ended with ``status`` and one ``error:`` line holding every needle; no traceback."""
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == status, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert err and err[-1].startswith("error: "), proc.stderr[-2000:]
    for needle in needles:
        assert str(needle) in err[-1], (needle, err[-1])
    return err[-1]


class Background:
    """A pretrain run started in the background; :meth:`done` waits for it and returns its output dir."""

    def __init__(self, out: Path, data) -> None:
        self.out, self.log = out, out.parent / "reference.log"
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(pretrain_argv(out, data), cwd=REPO, env=subprocess_env(), stdout=fh,
                                         stderr=subprocess.STDOUT)

    def done(self) -> Path:
        assert self.proc.wait(timeout=600) == 0, self.log.read_text()[-3000:]
        return self.out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, austen_data):
    """An uninterrupted run (started at once, it runs beside the first test): the losses every interrupted run
    must reproduce, and a finished run to rerun."""
    run = Background(tmp_path_factory.mktemp("reference") / "run", austen_data)
    yield run
    if run.proc.poll() is None:
        run.proc.kill()
        run.proc.wait()


# ------------------------------------------------------------------------------------------ kills


def latest_is_loadable(ck: Path) -> None:
    """What a rerun resumes from exists: the checkpoint ``latest`` names (when there is one) is a complete
    directory."""
    latest = ck / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        assert (ck / tag / "manifest.json").is_file(), (tag, sorted(p.name for p in ck.iterdir()))


def test_kills_at_every_commit_instant_then_the_reruns_reproduce_the_uninterrupted_losses(
        tmp_path, austen_data, reference):
    """One run killed (or hitting a full disk) at each instant of its first save, of a re-save of a step that
    exists (a rerun resumed at its last step saves it again), and of the export, rerun after each: every rerun
    resumes, and the run ends with every step's loss equal, bit for bit, to the uninterrupted run's, an export that
    loads, one validation row per evaluated step and no leftovers."""
    out = tmp_path / "run"
    ck = out / "checkpoints"

    def killed(point, *extra):
        proc = pretrain(out, austen_data, *extra, env={"HYBRIDLM_FAULT_KILL_IN": point})
        assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
        latest_is_loadable(ck)
        return proc

    # the first save: renamed into place, `latest` not written yet; the rerun resumes from it
    killed("save-committed:2")
    assert (ck / "step_2" / "manifest.json").is_file() and not (ck / "latest").exists()
    # a full disk in the step-4 save: one line, its partial directory removed
    full = pretrain(out, austen_data, env={"HYBRIDLM_FAULT_DISK_FULL_IN": "save:4"})
    assert "resumed from" in full.stdout and "at step 2" in full.stdout
    one_error_line(full, 4, "disk is full", ".tmp_step_4")
    assert not (ck / ".tmp_step_4").exists() and (ck / "step_2").is_dir()
    # killed writing final/: nothing of it in place
    killed("export")
    assert not (out / "final").exists() and (ck / "latest").read_text().strip() == "step_4"
    # re-saves of step 4 (each rerun resumes at step 4 and saves it again): killed with the new copy renamed
    # into place but not named by `latest`, then with `latest` flipped but the old copies not deleted
    proc = killed("save-committed:4")
    assert "at step 4" in proc.stdout and (ck / "latest").read_text().strip() == "step_4"
    killed("save-latest:4")
    assert (ck / "latest").read_text().strip() != "step_4"
    # a full disk in the export: one line, no partial export left
    full = pretrain(out, austen_data, env={"HYBRIDLM_FAULT_DISK_FULL_IN": "export"})
    one_error_line(full, 4, "disk is full", "final")
    assert not list(out.glob(".final.*")) and not (out / "final").exists()
    # the export: complete but result.json not written; then a re-export killed with the old final/ renamed aside,
    # and with the new one in place and the old one not yet deleted
    killed("export-done")
    assert (out / "final" / ".complete").is_file() and not (out / "result.json").exists()
    killed("export-aside")
    assert not (out / "final").exists() and len(list(out.glob(".final.old-*"))) == 1
    killed("export-placed")
    assert (out / "final" / ".complete").is_file() and (out / "final" / "tokenizer.json").is_file()

    finished = pretrain(out, austen_data)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resumed from" in finished.stdout and "at step 4" in finished.stdout
    assert losses(out) == losses(reference.done())  # exact float equality, every step
    val_steps = [r["step"] for r in rows(out) if "val_loss" in r]
    assert val_steps == [2, 4], val_steps  # a rerun resumed at the last step logs its validation once
    names = sorted(p.name for p in ck.iterdir())
    assert not [n for n in names if n.startswith((".tmp_", ".trash_"))], names
    assert len([n for n in names if n.startswith("step_4")]) == 1, names
    assert not list(out.glob(".final.*"))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import hybridlm.model  # noqa: F401  (registers the model type)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert AutoTokenizer.from_pretrained(out / "final").vocab_size > 0
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    again = pretrain(out, austen_data)
    assert again.returncode == 0 and "run already complete" in again.stdout


def test_a_step_saved_again_goes_into_a_fresh_directory_and_latest_flips_to_it(tmp_path):
    """Saving a step that exists writes ``step_<N>.<k>``; ``latest`` names a complete checkpoint before and after,
    and the earlier copy is deleted only once ``latest`` names the new one."""
    from hybridlm.engine import Engine, init_distributed

    init_distributed()
    eng = Engine(W.build_model(), W.make_config("fp32"), W.loss_fn)
    eng.train_step(W.local_micro_batches(W.global_batches(1, 4)[0], 0, 1, 2))
    ck = tmp_path / "ck"
    first = eng.save_checkpoint(ck, 1, {"copy": 1})
    second = eng.save_checkpoint(ck, 1, {"copy": 2}, keep_last=2)
    assert Path(first).name == "step_1" and Path(second).name == "step_1.1"
    assert (ck / "latest").read_text().strip() == "step_1.1" and not Path(first).exists()
    third = eng.save_checkpoint(ck, 1, {"copy": 3})
    assert Path(third).name == "step_1" and (ck / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_1"]
    fresh = Engine(W.build_model(seed=3), W.make_config("fp32"), W.loss_fn)
    assert fresh.load_checkpoint(ck) == {"copy": 3} and fresh.global_step == 1


# ------------------------------------------------------------------------------------------- lock


def _wait_stopped(proc: subprocess.Popen, deadline: float) -> None:
    """Until ``proc`` is stopped (SIGSTOP): its state in /proc is T."""
    pid = proc.pid
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process {pid} ended ({proc.returncode}) instead of stopping"
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not stop")


def test_a_second_process_on_a_run_directory_is_refused_naming_the_holder(tmp_path, austen_data):
    out = tmp_path / "run"
    first = subprocess.Popen(pretrain_argv(out, austen_data, "optim.max_steps=2", "run.export=false"), cwd=REPO,
                             env=subprocess_env(HYBRIDLM_FAULT_STOP_AT_STEP="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_stopped(first, time.monotonic() + 300)  # frozen after step 1, holding the directory
        second = pretrain(out, austen_data, "optim.max_steps=2", "run.export=false")
        one_error_line(second, 4, str(out), f"process {first.pid}")
    finally:
        os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    steps = [r["step"] for r in rows(out) if "loss" in r]
    assert steps == [1, 2], steps  # each step logged once: the second process trained nothing

    # the holder has ended: the directory is free. Continued with a longer schedule (2 -> 3 steps), the new
    # schedule applies from step 3, and one line says so
    longer = pretrain(out, austen_data, "optim.max_steps=3", "run.export=false")
    assert longer.returncode == 0, longer.stderr[-2000:]
    note = [line for line in longer.stdout.splitlines() if line.startswith("resumed with changed settings")]
    assert len(note) == 1 and "optim.max_steps 2 -> 3" in note[0] and "step 3" in note[0], longer.stdout[-2000:]
    from hybridlm.engine import lr_at
    lr = {r["step"]: r["lr"] for r in rows(out) if "lr" in r}
    assert lr[3] == pytest.approx(lr_at(2, lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=3), rel=1e-12)
    assert lr[3] != pytest.approx(3e-4)  # not the 2-step schedule's min_lr


# ------------------------------------------------------------------------------------- corruption


def test_corrupt_checkpoint_bytes_are_refused_naming_the_file(tmp_path):
    from hybridlm.engine import CheckpointError, Engine, init_distributed

    init_distributed()
    eng = Engine(W.build_model(), W.make_config("fp32"), W.loss_fn)
    eng.train_step(W.local_micro_batches(W.global_batches(1, 4)[0], 0, 1, 2))
    ck = tmp_path / "ck"
    eng.save_checkpoint(ck, 1, {})
    victim = ck / "step_1" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)  # 64 bytes overwritten inside the file, its size unchanged
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        Engine(W.build_model(seed=3), W.make_config("fp32"), W.loss_fn).load_checkpoint(ck)
    msg = str(e.value)
    assert "\n" not in msg and "mp_rank_00_model_states.pt" in msg and "sha256" in msg, msg


def _damaged_copy(src: Path, dst: Path, damage: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    meta_file = dst / "meta.json"
    meta = json.loads(meta_file.read_text())
    shard = dst / meta["splits"]["train"]["shards"][0]["file"]
    if damage in ("garbage", "garbage-hash-edited"):  # same size, other bytes (valid token ids)
        np.fromfile(shard, dtype=meta["dtype"])[::-1].tofile(shard)
        if damage == "garbage-hash-edited":  # and meta.json edited to record the new hash
            meta["splits"]["train"]["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
            meta_file.write_text(json.dumps(meta))
    elif damage == "zeros":
        shard.write_bytes(bytes(shard.stat().st_size))
    elif damage in ("dtype", "dtype-no-digest"):  # read as another dtype, every count edited to agree
        meta["dtype"] = "uint16"
        for split in meta["splits"].values():
            split["num_tokens"] *= 2
            for sh in split["shards"]:
                sh["num_tokens"] *= 2
        if damage == "dtype-no-digest":
            del meta["digest"]
        meta_file.write_text(json.dumps(meta))
    elif damage == "vocab":
        meta["tokenizer"]["vocab_size"] = 0
        del meta["digest"]
        meta_file.write_text(json.dumps(meta))
    elif damage == "eos":
        meta["tokenizer"]["eos_id"] = meta["tokenizer"]["vocab_size"] + 5
        del meta["digest"]
        meta_file.write_text(json.dumps(meta))
    return shard


@pytest.mark.parametrize("damage,named,words", [
    ("garbage", "shard", "sha256"),
    ("zeros", "shard", "sha256"),
    ("garbage-hash-edited", "meta", "digest"),
    ("dtype", "meta", "dtype"),
    ("dtype-no-digest", "meta", "dtype"),
    ("vocab", "meta", "vocab_size"),
    ("eos", "meta", "eos_id"),
])
def test_corrupt_prepared_data_is_refused_by_name(tmp_path, austen_data, damage, named, words):
    """What training opens (``open_splits``): shard bytes checked against meta.json's sha256, meta.json against
    its own digest and for an impossible vocabulary, EOS id or dtype."""
    from hybridlm.data.packed import open_splits

    data = tmp_path / "data"
    shard = _damaged_copy(Path(austen_data), data, damage)
    with pytest.raises(ConfigError) as e:
        open_splits(data, 32, 2, 2)
    msg = str(e.value)
    assert "\n" not in msg and words in msg, msg
    assert str(shard if named == "shard" else data / "meta.json") in msg, msg


# ---------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("change", [{"max_steps": 4}, {"lr": 3e-3}, {"max_steps": 6, "schedule": "wsd"}])
def test_a_schedule_changed_on_resume_applies_from_the_resume_step_and_is_stated(tmp_path, change):
    """Saved after 2 steps of a 2-step schedule, resumed with a longer schedule (or another peak lr): the next
    step's lr is the new schedule's at 2 applied updates, not the old schedule's, and not a blend; one line says
    which settings changed."""
    from hybridlm.engine import Engine, init_distributed, lr_at

    init_distributed()
    old = W.make_config("fp32", max_steps=2, warmup_steps=1)
    eng = Engine(W.build_model(), old, W.loss_fn)
    batches = W.global_batches(4, 4)
    for b in batches[:2]:
        eng.train_step(W.local_micro_batches(b, 0, 1, 2))
    eng.save_checkpoint(tmp_path / "ck", 2, {})

    new = W.make_config("fp32", **{"max_steps": 2, "warmup_steps": 1, **change})
    resumed = Engine(W.build_model(seed=5), new, W.loss_fn)
    resumed.load_checkpoint(tmp_path / "ck")
    note = resumed.resume_note
    assert note and "\n" not in note and "step 3" in note
    for key, value in change.items():
        assert f"optim.{key} {getattr(old, key)} -> {value}" in note, note
    for applied, b in enumerate(batches[2:4], start=2):
        want = lr_at(applied, lr=new.lr, min_lr=new.min_lr, warmup_steps=new.warmup_steps, max_steps=new.max_steps,
                     schedule=new.schedule, decay_fraction=new.decay_fraction)
        assert resumed.train_step(W.local_micro_batches(b, 0, 1, 2)).lr == pytest.approx(want, rel=1e-12)

    same = Engine(W.build_model(seed=5), old, W.loss_fn)  # unchanged settings: nothing to say
    same.load_checkpoint(tmp_path / "ck")
    assert same.resume_note is None


# ------------------------------------------------------------------------------------- one line


def test_bad_inputs_are_one_error_line(tmp_path, austen_data, reference):
    """Each is one ``error:`` line naming the file or the field, exit status 2, no traceback."""
    import shutil

    reference = reference.done()
    empty, blank, a_file = tmp_path / "empty.txt", tmp_path / "blank.txt", tmp_path / "a_file"
    empty.write_text("")
    blank.write_text("  \n\n\t \n")
    a_file.write_text("x")
    # a finished run rerun with a longer schedule (a resume) and another model shape / precision
    shaped, precise = tmp_path / "shaped", tmp_path / "precise"
    shutil.copytree(reference, shaped)
    shutil.copytree(reference, precise)
    # an export whose weights are a pickle that names code to run
    pickled = tmp_path / "pickled"
    shutil.copytree(reference / "final", pickled)
    subprocess.run([sys.executable, "-c", (
        "import os, sys, torch, safetensors.torch as st\n"
        "d = sys.argv[1]\n"
        "sd = dict(st.load_file(os.path.join(d, 'model.safetensors')))\n"
        "class P:\n    def __reduce__(self):\n        return (os.system, ('true',))\n"
        "sd['planted'] = P()\n"
        "torch.save(sd, os.path.join(d, 'pytorch_model.bin'))\n"
        "os.remove(os.path.join(d, 'model.safetensors'))\n"), str(pickled)], check=True, env=subprocess_env())
    pickled_llama = tmp_path / "pickled_llama"  # the same weights file in a folder whose config says llama
    shutil.copytree(pickled, pickled_llama)
    config = json.loads((pickled_llama / "config.json").read_text())
    (pickled_llama / "config.json").write_text(json.dumps({**config, "model_type": "llama",
                                                           "architectures": ["LlamaForCausalLM"]}))
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 4)

    prep = [sys.executable, "-m", "pretrain.prepare", "--tokenizer", "asset:llama3.2", "--quiet", "--sources"]
    commands = {
        "prepare-empty": (prep + [str(empty), "--out", str(tmp_path / "p1")], None),
        "prepare-blank": (prep + [str(blank), "--out", str(tmp_path / "p2")], None),
        "pretrain-empty": (pretrain_argv(tmp_path / "r1", tmp_path / "d1", f"data.sources=[{blank}]"), None),
        "output-dir-file": (pretrain_argv(a_file, austen_data), None),
        "complete-bad-override": (pretrain_argv(reference, austen_data, "model.mixer=lstm"), None),
        "shape": (pretrain_argv(shaped, austen_data, "optim.max_steps=6", "model.intermediate_size=96"), None),
        "precision": (pretrain_argv(precise, austen_data, "optim.max_steps=6", "optim.precision=bf16"), None),
        "eval-pickle": ([sys.executable, "-m", "hybridlm.eval", "ppl", "--model", str(pickled), "--text", str(text)],
                        None),
        "eval-pickle-llama": ([sys.executable, "-m", "hybridlm.eval", "ppl", "--model", str(pickled_llama), "--text",
                               str(text)], None),
        "sample-prompt-empty": (pretrain_argv(tmp_path / "r2", austen_data, "run.sample_prompt=", "run.sample_tokens=4"),
                                None),
    }
    done = run_all(commands)
    one_error_line(done["prepare-empty"], 2, "sources", str(empty))
    one_error_line(done["prepare-blank"], 2, "sources", str(blank))
    one_error_line(done["pretrain-empty"], 2, "data.sources", str(blank))
    assert not list(tmp_path.glob(".d1.tmp-*")) and not list(tmp_path.glob(".p1.tmp-*"))
    one_error_line(done["output-dir-file"], 2, "run.output_dir", str(a_file))
    one_error_line(done["complete-bad-override"], 2, "lstm")
    assert "run already complete" not in done["complete-bad-override"].stdout
    one_error_line(done["shape"], 2, "checkpoint", "tensor ", "shape", "model settings changed")
    one_error_line(done["precision"], 2, "optim.precision=fp32", "optim.precision=bf16")
    one_error_line(done["eval-pickle"], 2, str(pickled), "pytorch_model.bin", "posix.system")
    one_error_line(done["eval-pickle-llama"], 2, str(pickled_llama), "pytorch_model.bin", "posix.system")
    one_error_line(done["sample-prompt-empty"], 2, "run.sample_prompt")
    assert not (tmp_path / "r2" / "metrics.jsonl").exists()  # refused before training, not after the export


# ---------------------------------------------------------------------------------------- prepare


def _processes_with(token: str):
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_killed_prepare_leaves_no_workers_and_its_rerun_no_temporaries(tmp_path):
    text = tmp_path / "docs"
    text.mkdir()
    for i in range(8):
        (text / f"doc{i}.txt").write_text(f"Document {i}. " + "Emma Woodhouse, handsome, clever, and rich. " * 20)
    token = f"campaign-{os.getpid()}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "pretrain.prepare", "--tokenizer", "asset:llama3.2", "--quiet", "--num-proc", "2",
            "--sources", str(text), "--out", str(tmp_path / "out")]
    log = tmp_path / "killed.log"
    with open(log, "w") as fh:  # a file, not a pipe: an orphaned worker would hold a pipe open
        killed = subprocess.Popen(argv, cwd=REPO, env=subprocess_env(HYBRIDLM_FAULT_KILL_IN="prepare", CAMPAIGN=token),
                                  stdout=fh, stderr=subprocess.STDOUT)
        assert killed.wait(timeout=600) == -signal.SIGKILL, log.read_text()[-2000:]
    deadline = time.monotonic() + 60
    while _processes_with(token) and time.monotonic() < deadline:  # the kernel kills the workers with it
        time.sleep(0.05)
    left = _processes_with(token)
    for pid in left:  # (so that a failure leaves nothing running)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphaned workers of the killed prepare: {left}"
    assert list(tmp_path.glob(".out.tmp-*"))  # what the killed prepare had started
    again = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not list(tmp_path.glob(".out.tmp-*")) and (tmp_path / "out" / "meta.json").is_file()
