"""The long-context stage: its plan row, its settings checked before the route starts, the shipped CPU stage config.
The route running it between KD and DPO with RULER's tasks in its report, and ``upcycle kd`` alone on in-document
windows, are checked with every other lever in tests/test_route.py."""
import json

import pytest
from conftest import REPO
from test_upcycle_plan import tiny_route, tiny_teacher_config
from upcycle.plan import load_route, plan_route, plan_rows, teacher_config_for

H100_ROUTE = REPO / "configs" / "upcycle" / "smollm2_long_context_h100.yaml"
CPU_STAGE = REPO / "configs" / "upcycle" / "smollm2_long_context_cpu.yaml"


def test_plan_has_a_long_context_row_costed_like_kd_at_its_length():
    route = tiny_route()
    long = {"data": {"format": "documents", "seq_len": 256, "path": "data_cache/long"}, "kd": {"chunk_tokens": 16},
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
