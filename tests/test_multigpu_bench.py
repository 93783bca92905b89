"""benchmarks/multigpu.sh and benchmarks/multigpu.py on a CPU: the script's help and refusals, and the parts' logic
on 2 gloo ranks at tiny sizes through the same launcher (DeepSpeed's runner) and reports: a run saved on 2 ranks
resumed on 1, a rank SIGKILLed mid-run and the rerun resumed, and train_speed's per-rank ZeRO-1 shard at 1 and 2
ranks. The GPU runs themselves are the commands in BENCHMARKS.md, "Several GPUs"."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL, subprocess_env
from hybridlm.engine import free_port


def bench(*args, env=None, timeout=120):
    return subprocess.run(["bash", "benchmarks/multigpu.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env or subprocess_env())


def one_error_line(proc, start):
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(start), proc.stderr


def test_help_names_every_part_and_setting():
    proc = bench("--help", timeout=60)
    assert proc.returncode == 0
    for word in ("scaling", "losses", "resume", "kill", "route", "NGPUS=", "HYBRIDLM_NVLS", "OUT_DIR/scaling.json",
                 "OUT_DIR/resume.json", "OUT_DIR/kill.json", "OUT_DIR/route.json", "upcycle plan --gpus N"):
        assert word in proc.stdout, word


def test_without_cuda_one_line_and_exit_2(tmp_path):
    one_error_line(bench(str(tmp_path / "out")),
                   "error: benchmarks/multigpu.sh needs a CUDA GPU: torch.cuda.is_available() is False")


@pytest.fixture
def fake_gpus(tmp_path):
    """An interpreter that answers common.sh's CUDA probe with COUNT GPUs and runs everything else as Python does."""
    def make(count):
        fake = tmp_path / f"python{count}"
        fake.write_text(f'#!/usr/bin/env bash\ncase "${{2:-}}" in *device_count*) echo "{count} fake"; exit 0;; '
                        f'esac\nexec {sys.executable} "$@"\n')
        fake.chmod(0o755)
        return str(fake)
    return make


@pytest.mark.parametrize("count,extra,args,start", [
    (1, {}, [], "error: benchmarks/multigpu.sh needs at least 2 visible GPUs; 1 visible"),
    (4, {"NGPUS": "16"}, [], "error: NGPUS=16: none of these fits the 4 visible GPUs"),
    (4, {"NGPUS": "1"}, [], "error: NGPUS=1: the largest count must be at least 2"),
    (4, {"NGPUS": "two"}, [], "error: NGPUS: 'two' is not a GPU count"),
    (4, {}, ["speed"], "error: unknown part 'speed' (expected: scaling losses resume kill route)"),
])
def test_refusals_before_any_work(tmp_path, fake_gpus, count, extra, args, start):
    env = subprocess_env(PYTHON=fake_gpus(count), **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    one_error_line(bench(str(tmp_path / "out"), *args, env=env), start)
    assert not (tmp_path / "out" / "multigpu.log").exists()


# ------------------------------------------------------------------------------ the parts on 2 CPU ranks

def pretrain_argv(out, data, steps=8):
    return ["pretrain.py", "--config", "configs/experiments/default_cpu.yaml", f"data.path={data}", "data.sources=[]",
            "data.seq_len=32", "data.val_max_batches=2", "optim.micro_batch_size=2", "optim.global_batch_size=4",
            "optim.warmup_steps=2", f"optim.max_steps={steps}", f"run.output_dir={out}", "run.eval_interval=4",
            "run.save_interval=2", "run.sample_tokens=0", "run.export=false", "run.progress=false", *TINY_MODEL]


def ds_launch(ranks):
    """What benchmarks/common.sh's launch runs (on CPU: --num_gpus instead of CUDA_VISIBLE_DEVICES)."""
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
            str(free_port()), "--no_local_rank"]


def run(argv, **env):
    proc = subprocess.run(argv, cwd=REPO, env=subprocess_env(**env), capture_output=True, text=True, timeout=600)
    return proc


def report(*args):
    proc = run([sys.executable, "-m", "benchmarks.multigpu", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(open(args[args.index("--out") + 1]).read())


@pytest.mark.slow  # ~3-5 min on 2 shared cores: four launches of 2 ranks, one of 1
def test_resume_and_kill_parts_on_two_cpu_ranks(tmp_path, austen_data):
    ref = tmp_path / "reference"
    proc = run([*ds_launch(2), *pretrain_argv(ref, austen_data)])
    assert proc.returncode == 0, proc.stderr[-3000:]

    # resume: stopped by SIGTERM after step 4 on 2 ranks (its checkpoint saved), resumed on 1
    saved = tmp_path / "saved"
    proc = run([*ds_launch(2), *pretrain_argv(saved, austen_data)], HYBRIDLM_FAULT_TERM_AT_STEP="4")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert (saved / "checkpoints" / "latest").read_text().split(".")[0].strip() == "step_4"  # step_4 or step_4.1
    resumed = tmp_path / "resumed"
    shutil.copytree(saved, resumed, symlinks=True)
    proc = run([*ds_launch(1), *pretrain_argv(resumed, austen_data)])
    assert proc.returncode == 0 and "at step 4" in proc.stdout, proc.stderr[-3000:]
    got = report("losses", "--reference", str(ref), "--run", f"2to1={resumed}", "--after-step", "4", "--rtol", "1e-4",
                 "--out", str(tmp_path / "resume.json"))
    loss = got["runs"]["2to1"]["loss"]
    assert got["schema"] == "hybridlm-multigpu/1" and got["within"] is True
    assert (loss["steps"], loss["first_step"], loss["last_step"]) == (4, 5, 8) and loss["max_rel_diff"] < 1e-4
    assert got["runs"]["2to1"]["val_loss"]["steps"] == 1  # step 8's validation
    # a run that drifted is not called within: the resumed run's step-6 loss 1 % off in a copy
    drifted = tmp_path / "drifted"
    drifted.mkdir()
    rows = [json.loads(l) for l in (resumed / "metrics.jsonl").read_text().splitlines() if l.strip()]
    for r in rows:
        if r.get("step") == 6 and "loss" in r:
            r["loss"] *= 1.01
    (drifted / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    worse = report("losses", "--reference", str(ref), "--run", f"drifted={drifted}", "--after-step", "4",
                   "--rtol", "1e-3", "--out", str(tmp_path / "drifted.json"))
    assert worse["within"] is False and worse["runs"]["drifted"]["loss"]["max_rel_diff_step"] == 6

    # kill: rank 1 SIGKILLed during step 4 (a checkpoint at step 2): every rank stops, the rerun resumes at 2
    killed = tmp_path / "killed"
    got = report("kill", "--rank", "1", "--after-step", "3", "--delay", "0", "--timeout", "120",
                 "--metrics", str(killed / "metrics.jsonl"), "--log", str(tmp_path / "killed.log"),
                 "--out", str(tmp_path / "kill.json"), "--", *ds_launch(2), *pretrain_argv(killed, austen_data))
    assert got["killed"] is True and got["ranks_found"] == 2, got
    assert got["stopped"] is True and got["exit_code"] != 0 and got["ranks_left_alive"] == [], got
    assert got["seconds_to_stop"] < 120 and got["log"] == str(tmp_path / "killed.log")
    proc = run([*ds_launch(2), *pretrain_argv(killed, austen_data)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = int(proc.stdout.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert step in (2, 4)  # the last checkpoint before the kill
    got = report("losses", "--reference", str(ref), "--run", f"rerun={killed}", "--after-step", str(step),
                 "--rtol", "1e-4", "--out", str(tmp_path / "kill_rerun.json"))
    assert got["within"] is True and got["runs"]["rerun"]["loss"]["last_step"] == 8


@pytest.mark.slow  # ~1-2 min on 2 shared cores: train_speed at 1 and 2 CPU ranks
def test_scaling_reads_each_ranks_zero1_shard(tmp_path, austen_data):
    args = ["--data", str(austen_data), "--configs", "tiny_hybrid", "--peers", "--micro-batch", "2", "--seq", "32",
            "--steps", "2", "--warmup", "1"]
    speeds = []
    for n in (1, 2):
        out = tmp_path / f"speed_{n}"
        module = ["-m"] if n == 1 else ["--module"]
        proc = run([*ds_launch(n), *module, "benchmarks.train_speed", *args, "--out", str(out)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        speeds.append(f"{n}={out / 'train_speed.json'}")
    got = report("scaling", "--speed", *speeds, "--out", str(tmp_path / "scaling.json"))
    one, two = got["configs"]["tiny_hybrid"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["scaling_efficiency"] == 1.0
    assert len(one["optimizer_shard_gib_per_rank"]) == 1 and len(two["optimizer_shard_gib_per_rank"]) == 2
    assert two["global_batch"] == 2 * one["global_batch"] and two["tokens_per_s"] > 0
    # ZeRO-1: each of the 2 ranks holds about half of one rank's master weights and AdamW moments
    assert 0.45 < two["optimizer_shard_of_one_gpu"] < 0.56, two
    # a report of another rank count than named is refused
    proc = run([sys.executable, "-m", "benchmarks.multigpu", "scaling", "--speed", f"4={tmp_path / 'speed_2'}/train_speed.json",
                "--out", str(tmp_path / "x.json")])
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {tmp_path / 'speed_2'}/train_speed.json: world_size 2, not 4"


def write_route_report(tmp_path, dirname, ppl, acc, minutes):
    """A route folder with a report.json of the shape upcycle's report writes (docs/results/upcycling/
    smollm2_route_report.json): the perplexity rows per model and the stages' steps and minutes."""
    d = tmp_path / dirname
    d.mkdir()
    (d / "report.json").write_text(json.dumps({
        "perplexity": [{"model": "teacher", "ppl": 15.58, "ppl_b": 40.5, "kl": 0.0, "cloze_acc": 0.804},
                       {"model": "hybrid, after KD", "ppl": ppl, "ppl_b": 2.5 * ppl, "kl": 0.3, "cloze_acc": acc}],
        "stages": [{"stage": "KD-SFT", "steps": 1000, "max_steps": 1000, "tokens": 65472000, "minutes": minutes}]}))
    return d


def test_route_comparison_reads_both_reports(tmp_path):
    def route(dirname, ppl, acc, minutes):
        return write_route_report(tmp_path, dirname, ppl, acc, minutes)
    one, same, off = route("one", 18.0, 0.70, 11.0), route("same", 18.05, 0.71, 2.0), route("off", 19.0, 0.60, 2.0)
    got = report("route", "--one", str(one), "--many", str(same), "--out", str(tmp_path / "a.json"))
    assert got["within"] is True and got["stages"][0]["speedup"] == pytest.approx(5.5)
    kd = got["models"][1]
    assert kd["ppl"]["rel_diff"] == pytest.approx(0.05 / 18.0) and kd["cloze_acc"]["diff"] == pytest.approx(0.01)
    got = report("route", "--one", str(one), "--many", str(off), "--out", str(tmp_path / "b.json"))
    assert got["within"] is False and got["models"][0]["within"] is True and got["models"][1]["within"] is False


@pytest.mark.slow  # ~40 s: upcycle plan of the SmolLM2 route at 1 and 8 ranks
def test_route_report_carries_the_plan_and_each_gpus_memory(tmp_path):
    one, many = write_route_report(tmp_path, "one", 18.0, 0.70, 11.0), write_route_report(tmp_path, "many", 18.0, 0.70, 2.0)
    # nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 1000 (MiB)
    (tmp_path / "one.csv").write_text("0, 1024\n0, 51200\n0, 2048\n")
    (tmp_path / "many.csv").write_text("0, 8192\n1, 9216\n0, 4096\n1, not a number\n")
    lowered = ["ild.optim.micro_batch_size=8", "kd.optim.micro_batch_size=8", "dpo.optim.micro_batch_size=2"]
    got = report("route", "--one", str(one), "--many", str(many), "--memory", str(tmp_path / "one.csv"),
                 str(tmp_path / "many.csv"), "--plan-config", "configs/upcycle/smollm2_route_h200.yaml", "--gpus", "8",
                 "--plan-override", *lowered, "--out", str(tmp_path / "route.json"))
    assert got["gpu_memory_used_peak_gib"] == {"one_gpu": {"0": 50.0}, "several": {"0": 8.0, "1": 9.0}}
    plan = got["plan"]
    assert plan["overrides_several"] == lowered
    for stage in ("ild_mla", "ild_mamba2", "kd", "dpo"):
        one_gpu, several = plan["one_gpu"][stage], plan["several"][stage]
        assert (one_gpu["ranks"], several["ranks"]) == (1, 8)
        assert several["micro_batch"] * 8 == one_gpu["micro_batch"] or stage == "dpo"
        assert several["total_gib"] < one_gpu["total_gib"] and 0 < several["wall_minutes"] < one_gpu["wall_minutes"]
    assert plan["one_gpu"]["smart"]["ranks"] == plan["several"]["smart"]["ranks"] == 1  # SMART runs on rank 0
