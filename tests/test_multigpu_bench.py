"""benchmarks/multigpu.sh and benchmarks/multigpu.py on a CPU: the script's help and refusals, and the parts' logic
on 2 gloo ranks at tiny sizes through the same launcher (DeepSpeed's runner) and reports: a run saved on 2 ranks
resumed on 1, a rank SIGKILLed mid-run and the rerun resumed, and train_speed's per-rank ZeRO-1 shard at 1 and 2
ranks. The GPU runs themselves are the commands in BENCHMARKS.md, "Several GPUs"."""
import json
import subprocess
import sys

import pytest
import yaml

from benchmarks.multigpu import main as multigpu_main
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
    for word in ("scaling", "losses", "resume", "kill", "route", "NGPUS=", "HYBRIDLM_NVLS",
                 "OUT_DIR/scaling_<config>.json",
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
    (4, {"HYBRIDLM_NVLS": "on"}, [], "error: HYBRIDLM_NVLS=on: expected 0 (multicast off, the default) or 1"),
])
def test_refusals_before_any_work(tmp_path, fake_gpus, count, extra, args, start):
    env = subprocess_env(PYTHON=fake_gpus(count), **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    one_error_line(bench(str(tmp_path / "out"), *args, env=env), start)
    assert not (tmp_path / "out" / "multigpu.log").exists()


# ------------------------------------------------------------------------------ the parts on 2 CPU ranks

def report(*args):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multigpu", *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(open(args[args.index("--out") + 1]).read())


def dotted(overrides):
    """TINY_MODEL's overrides as KEY=VALUE words without spaces (``model.mla={...}`` -> ``model.mla.num_heads=2`` ...),
    for a setting the script splits into words."""
    out = []
    for item in overrides:
        key, value = item.split("=", 1)
        parsed = yaml.safe_load(value)
        out += [f"{key}.{k}={v}" for k, v in parsed.items()] if isinstance(parsed, dict) else [item]
    return out


@pytest.mark.slow  # ~7 min on 2 shared cores (412 s): eleven launches, 2 CPU ranks through DeepSpeed's launcher
def test_the_scripts_parts_on_two_cpu_ranks(tmp_path, austen_data, fake_gpus):
    """scaling, losses, resume and kill as the script runs them, on 2 gloo ranks (DeepSpeed's CPU accelerator counts
    LOCAL_SIZE devices) with a tiny model of every sublayer kind on the real corpus and tokenizer."""
    out = tmp_path / "out"
    tiny = [*dotted(TINY_MODEL), "data.seq_len=32", "data.sources=[]", "optim.micro_batch_size=2",
            "optim.global_batch_size=8", "optim.warmup_steps=2"]
    env = subprocess_env(PYTHON=fake_gpus(2), LOCAL_SIZE="2", NGPUS="1 2", DATA=str(austen_data), SEQ="32",
                         SCALING_CONFIGS="tiny_hybrid:2", LOSS_STEPS="8", RTOL="1e-4", MASTER_PORT=str(free_port()),
                         PRETRAIN_CONFIG="configs/experiments/default_cpu.yaml", PRETRAIN_OVERRIDES=" ".join(tiny))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = bench(str(out), "scaling", "losses", "resume", "kill", env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    # scaling: 1 and 2 ranks; ZeRO-1 leaves each of 2 ranks about half of one rank's master weights and moments
    scaling = json.loads((out / "scaling_tiny_hybrid.json").read_text())
    one, two = scaling["configs"]["tiny_hybrid"]
    assert (one["ranks"], two["ranks"], one["scaling_efficiency"]) == (1, 2, 1.0)
    assert two["global_batch"] == 2 * one["global_batch"] and two["tokens_per_s"] > 0
    assert len(one["optimizer_shard_gib_per_rank"]) == 1 and len(two["optimizer_shard_gib_per_rank"]) == 2
    assert 0.45 < two["optimizer_shard_of_one_gpu"] < 0.56, two

    # losses: 2 ranks against 1 over the same batches (fp32: the order of the gradient sums alone)
    losses = json.loads((out / "losses.json").read_text())
    assert losses["within"] is True and losses["runs"]["2gpu"]["loss"]["steps"] == 8

    # resume: saved on 2 after step 20, resumed on 1; saved on 1, resumed on 2; steps 21-30 against the reference
    resume = json.loads((out / "resume.json").read_text())
    assert set(resume["runs"]) == {"2to1", "1to2"} and resume["within"] is True, resume
    for run in resume["runs"].values():
        assert (run["loss"]["first_step"], run["loss"]["last_step"], run["loss"]["steps"]) == (21, 30, 10)
    assert "at step 20" in (out / "resumed_2to1gpu.log").read_text()

    # kill: rank 1 SIGKILLed mid-run; every rank stopped, none left; the rerun resumed and matches the reference
    kill = json.loads((out / "kill.json").read_text())
    assert kill["killed"] and kill["stopped"] and kill["ranks_found"] == 2 and kill["ranks_left_alive"] == [], kill
    assert kill["exit_code"] != 0 and kill["seconds_to_stop"] < 180 and kill["tracebacks"] == 0, kill
    rerun = json.loads((out / "kill_rerun.json").read_text())
    assert rerun["within"] is True and rerun["runs"]["rerun"]["loss"]["last_step"] == 30
    assert rerun["after_step"] in (10, 20)  # the last checkpoint before the kill

    # a run that drifted is not called within: the resumed run's step-25 loss 1 % off, in a copy
    drifted = tmp_path / "drifted"
    drifted.mkdir()
    rows = [json.loads(l) for l in (out / "resumed_2to1gpu" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    for r in rows:
        if r.get("step") == 25 and "loss" in r:
            r["loss"] *= 1.01
    (drifted / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    worse = report("losses", "--reference", str(out / "reference_2gpu"), "--run", f"drifted={drifted}",
                   "--after-step", "20", "--rtol", "1e-3", "--out", str(tmp_path / "drifted.json"))
    assert worse["within"] is False and worse["runs"]["drifted"]["loss"]["max_rel_diff_step"] == 25


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
    got = multigpu_main(["route", "--one", str(one), "--many", str(same), "--out", str(tmp_path / "a.json")])
    assert got["within"] is True and got["stages"][0]["speedup"] == pytest.approx(5.5)
    assert json.loads((tmp_path / "a.json").read_text()) == got  # the report as written
    kd = got["models"][1]
    assert kd["ppl"]["rel_diff"] == pytest.approx(0.05 / 18.0) and kd["cloze_acc"]["diff"] == pytest.approx(0.01)
    got = multigpu_main(["route", "--one", str(one), "--many", str(off), "--out", str(tmp_path / "b.json")])
    assert got["within"] is False and got["models"][0]["within"] is True and got["models"][1]["within"] is False


@pytest.mark.slow  # 6 s after the other tests, ~40 s alone: upcycle plan of the SmolLM2 route at 1 and 8 ranks
def test_route_report_carries_the_plan_and_each_gpus_memory(tmp_path):
    one = write_route_report(tmp_path, "one", 18.0, 0.70, 11.0)
    many = write_route_report(tmp_path, "many", 18.0, 0.70, 2.0)
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
