"""The long-context stage: its plan row, ``upcycle kd`` alone on in-document windows, and the route running it
between KD and DPO with the RULER-style tasks in its report."""
import json
import subprocess
import sys

import pytest
from conftest import REPO, assert_chart, demo_file, save_tiny_llama, subprocess_env
from test_upcycle_plan import tiny_route, tiny_teacher_config
from upcycle.plan import load_route, plan_route, plan_rows, teacher_config_for

H100_ROUTE = REPO / "configs" / "upcycle" / "smollm2_long_context_h100.yaml"
CPU_STAGE = REPO / "configs" / "upcycle" / "smollm2_long_context_cpu.yaml"


def test_plan_has_a_long_context_row_costed_like_kd_at_its_length():
    route = tiny_route()
    long = {"data": {"format": "documents", "seq_len": 256}, "kd": {"chunk_tokens": 16},
            "optim": {"micro_batch_size": 1, "global_batch_size": 4, "max_steps": 5, "lr": 1e-5}}
    plans = {p.name: p for p in plan_route({**route, "long_context": long}, tiny_teacher_config(True), 2).stages}
    assert list(plans) == ["init", "ild_mla", "ild_mamba2", "smart", "kd", "long_context", "dpo"]
    lc = plans["long_context"]
    assert (lc.micro_batch, lc.seq_len, lc.tokens) == (1, 256, 5 * 4 * 256)
    # the same model and optimizer as KD; KD's activations per token, at the stage's own tokens per micro-batch
    kd = plans["kd"]
    for key in ("teacher weights (bf16)", "student weights (bf16)", "gradients (bf16 + fp32 accumulator)",
                "master + Adam (fp32, ZeRO-1)"):
        assert lc.bytes[key] == kd.bytes[key]
    assert lc.bytes["activations"] / (1 * 256) == pytest.approx(kd.bytes["activations"] / (2 * 32), rel=1e-9)
    assert lc.flops / lc.tokens > kd.flops / kd.tokens  # attention costs more per token at a longer context
    assert "long_context" not in {p.name for p in plan_route(route, tiny_teacher_config(True), 2).stages}


def test_gpu_route_plans_its_8k_stage_on_one_80gb_card():
    cfg = load_route(H100_ROUTE)
    assert cfg["long_context"]["data"]["seq_len"] == 8192 and cfg["long_context"]["data"]["format"] == "documents"
    assert cfg["report"]["ruler_lengths"] == [4096, 8192]
    teacher = teacher_config_for(cfg, None)  # asset:smollm2's config.json
    rows = {r["stage"]: r for r in plan_rows(plan_route(cfg, teacher, 1).stages, 1, 989.0, 0.3)}
    assert rows["long_context"]["total_gib"] < 80 and rows["long_context"]["tokens"] == 300 * 8 * 8192
    assert rows["long_context"]["wall_hours"] * 60 * 2.5 < 10  # the config's comment: under ten minutes
    assert "asset:sotu" not in json.dumps(cfg["long_context"])  # the RULER haystack stays held out


@pytest.mark.parametrize("override,message", [
    ("long_context.optim.lrr=1e-6", "error: long_context.optim: unknown key 'lrr'"),
    ("long_context.data.format=books", "error: long_context.data.format: 'books' is not one of chat, packed, documents"),
    ("report.ruler_lengths=[32]", "error: report.ruler_lengths: expected context lengths of at least 64 tokens"),
    ("report.ruler_tasks=[niah_single_9]", "error: report.ruler_tasks: unknown task 'niah_single_9'"),
])
def test_route_checks_the_long_context_and_ruler_settings_before_the_first_stage(tmp_path, override, message,
                                                                                 monkeypatch, capsys):
    from upcycle.cli import main
    out = tmp_path / "route"
    monkeypatch.chdir(REPO)
    lc = ["long_context.data.format=documents", "long_context.data.path=data_cache/alpaca-smollm2",
          "long_context.data.seq_len=1024", "long_context.optim.lr=1e-5", "report.ruler_lengths=[1024]"]
    rc = main(["run", "--config", "configs/upcycle/smollm2_route_cpu.yaml", f"output_dir={out}", *lc, override])
    err = capsys.readouterr().err
    assert rc == 2, err[-1500:]
    assert err.strip().splitlines()[-1].startswith(message), err[-800:]
    assert "Traceback" not in err and not out.exists()


def test_cpu_stage_config_builds_a_documents_kd_stage():
    from distill.kd import KD_SECTIONS, kd_configs
    from hybridlm.config.loader import load_config
    from hybridlm.data.document_windows import DocumentDataConfig
    built = kd_configs(load_config(str(CPU_STAGE), [], sections=KD_SECTIONS))
    assert isinstance(built["data"], DocumentDataConfig) and built["data"].seq_len == 2048


# 6 minutes on 2 cores shared with other jobs (tests/test_route.py's route: ~150 s on 2 idle cores): the whole route,
# each stage one step, RULER's vt on six models, then `upcycle kd` alone
@pytest.mark.slow
def test_route_runs_long_context_between_kd_and_dpo_and_reports_ruler(tmp_path):
    for name in ("dpo_en_demo.json", "alpaca_en_demo.json"):
        demo_file(name)
    teacher = save_tiny_llama(tmp_path / "teacher")
    out = tmp_path / "route"
    small = ["optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=1", "optim.warmup_steps=1",
             "run.progress=false", "run.eval_interval=0", "run.save_interval=0", "data.val_max_batches=1"]
    overrides = [f"output_dir={out}", f"teacher={teacher}", "init.kv_lora_rank=32", "init.qk_rope_head_dim=8",
                 "init.calib_tokens=0", f"ild.data.path={tmp_path / 'data'}", "ild.data.sources=[asset:alpaca_en_demo]",
                 "ild.data.seq_len=32", "smart.n_mla=2", "smart.batches=1", "smart.batch_size=2",
                 "kd.data.path=asset:alpaca_en_demo", "kd.data.max_length=64",
                 # KD again at 96 tokens, on windows inside one alpaca record of the ILD data
                 "long_context.data.format=documents", f"long_context.data.path={tmp_path / 'data'}",
                 "long_context.data.seq_len=96", "long_context.optim.lr=1e-4", "long_context.optim.precision=fp32",
                 "dpo.data.path=asset:dpo_en_demo", "dpo.data.max_length=64", "dpo.data.max_prompt_length=32",
                 "report.seq_len=32", "report.max_tokens=256", "report.generation_prompts=0",
                 "report.ruler_lengths=[640]", "report.ruler_items=1", "report.ruler_tasks=[vt]"]
    overrides += [f"{stage}.{o}" for stage in ("ild", "kd", "long_context", "dpo") for o in small]
    cmd = [sys.executable, "-m", "upcycle.cli", "run", "--config", "configs/upcycle/smollm2_route_cpu.yaml", *overrides]
    run = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    stages = [l.split()[3] for l in run.stdout.splitlines() if l.startswith("route: stage ")]
    assert stages == ["init", "ild_mla", "ild_mamba2", "smart", "compose", "kd", "long_context", "dpo", "report"]
    long = json.loads((out / "long_context" / "final" / "stage.json").read_text())
    assert long["steps"] == 1 and long["config"]["data"]["seq_len"] == 96
    assert long["tokens"] == 2 * 95  # one step of two in-document windows, each window's last target dropped (KD)
    assert json.loads((out / "dpo" / "final" / "stage.json").read_text())["reference"] == \
        str(out / "long_context" / "final")  # DPO starts from the long-context hybrid
    report = json.loads((out / "report.json").read_text())
    rows = {r["model"]: r for r in report["perplexity"]}
    assert list(rows) == ["teacher", "hybrid, init only", "hybrid after ILD", "after KD-SFT",
                          "after long-context KD", "after DPO"]
    assert all(0.0 <= r["ruler_640"] <= 1.0 for r in rows.values())
    assert rows["after long-context KD"]["tokens_trained"] - rows["after KD-SFT"]["tokens_trained"] == 2 * 95
    assert "Long-context KD" in [s["stage"] for s in report["stages"]]
    ruler = json.loads((out / "ruler.json").read_text())
    assert [m["label"] for m in ruler["models"]] == list(rows)
    assert ruler["tasks"] == ["vt"] and ruler["lengths"] == [640]
    for m in ruler["models"]:
        assert m["average"]["640"] == pytest.approx(rows[m["label"]]["ruler_640"])
        assert [s["task"] for s in m["samples"]] == ["vt"] and m["samples"][0]["tokens"] + 30 <= 640
    assert "RULER @ 640, %" in (out / "report.md").read_text()
    assert "| teacher @ 640 | hybrid, init only @ 640 |" in (out / "ruler.md").read_text()
    assert_chart(out / "ruler.png")

    # `upcycle kd` alone, with the shipped stage config pointed at the same student and data, trains the same step
    alone = tmp_path / "long_context_alone"
    kd = [sys.executable, "-m", "upcycle.cli", "kd", "--config", str(CPU_STAGE), f"teacher.path={teacher}",
          f"student.path={out / 'kd' / 'final'}", f"data.path={tmp_path / 'data'}", "data.sources=[]",
          "data.seq_len=96", "data.val_max_batches=1", "optim.micro_batch_size=2", "optim.global_batch_size=2",
          "optim.max_steps=1", "optim.warmup_steps=1", "optim.lr=1e-4", "optim.min_lr=5e-6", "run.progress=false",
          "run.eval_interval=0", "run.save_interval=0", f"run.output_dir={alone}"]
    res = subprocess.run(kd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [[json.loads(l)["loss"] for l in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
              for d in (out / "long_context", alone)]
    assert len(losses[0]) == 1 and losses[0] == pytest.approx(losses[1], rel=1e-6)
