"""Intermediate Layer Distillation: teacher-forced per-layer loss and the ``upcycle ild`` stage."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import REPO, assert_chart, save_tiny_llama, demo_file, subprocess_env
from distill.ild import ild_loss, teacher_trace
from hybridlm.model import HybridForCausalLM
from upcycle.init_from_teacher import init_student_from_teacher
from upcycle.student import student_config


def tiny_teacher(n_kv=1, vocab=128):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=n_kv, head_dim=16, vocab_size=vocab, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def student_of(teacher, kinds, **kw):
    cfg = student_config(teacher.config, kinds, **{"kv_lora_rank": 128, "qk_rope_head_dim": 8, **kw})
    student = HybridForCausalLM(cfg)
    init_student_from_teacher(student, teacher, kinds)
    return student


def test_trace_chains_layers():
    teacher = tiny_teacher()
    ids = torch.randint(0, 128, (2, 17))
    trace = teacher_trace(teacher, ids)
    assert len(trace) == 3
    for (x0, a0, y0), (x1, _, _) in zip(trace, trace[1:]):
        assert torch.equal(y0, x1)  # layer i's output is layer i+1's input
    assert torch.equal(trace[0][0], teacher.model.embed_tokens(ids))


def test_exact_student_has_zero_ild_loss_and_a_random_one_does_not():
    """An MLA student that reproduces each attention exactly (one kv head, full rank, every dim rotating)
    gets ~0 loss; an all-Mamba2 student does not; gradients reach only the student's layers."""
    teacher = tiny_teacher(n_kv=1)
    ids = torch.randint(0, 128, (2, 17))
    exact = student_of(teacher, ["mla"] * 3, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16)
    loss, metrics = ild_loss(exact, teacher, ids)
    assert loss.item() < 1e-4 * 3 and metrics["layer_l2"] < 1e-4
    mamba = student_of(teacher, ["mamba2"] * 3)
    loss, _ = ild_loss(mamba, teacher, ids)
    assert loss.item() > 0.1
    loss.backward()
    assert mamba.model.embed_tokens.weight.grad is None
    assert mamba.model.layers[0].mixer.in_proj.weight.grad.abs().sum() > 0


def test_proxy_swapped_perplexity_against_direct_computations(tmp_path):
    """benchmarks.harness.ild_proxy.swapped_perplexity: no layers swapped is the teacher's own perplexity; a swapped-in
    block whose mixer is silent (out_proj = 0) equals the teacher with that layer's attention output zeroed
    (computed here by a hook on the attention); the hooks are gone afterwards. The chart draws both panels."""
    import math

    from benchmarks.harness.ild_proxy import plot_curves, swapped_perplexity

    teacher = tiny_teacher()
    ids = torch.randint(0, 128, (2, 17))
    with torch.no_grad():
        own = math.exp(teacher(input_ids=ids, labels=ids).loss.item())
    assert swapped_perplexity(teacher, None, [], ids) == pytest.approx(own, rel=1e-6)
    student = student_of(teacher, ["mamba2"] * 3)
    with torch.no_grad():
        student.model.layers[2].mixer.out_proj.weight.zero_()  # layer 1's mixer says nothing
    handle = teacher.model.layers[1].self_attn.register_forward_hook(
        lambda m, a, out: (torch.zeros_like(out[0]),) + tuple(out[1:]))
    with torch.no_grad():
        silent = math.exp(teacher(input_ids=ids, labels=ids).loss.item())
    handle.remove()
    assert abs(silent - own) > 1e-3 * own
    assert swapped_perplexity(teacher, student, [1], ids) == pytest.approx(silent, rel=1e-5)
    assert swapped_perplexity(teacher, None, [], ids) == pytest.approx(own, rel=1e-6)  # no hook left behind
    curve = [{"tokens": t, "rel_err": e, "ppl": q} for t, e, q in ((0, 1.0, 90.0), (1024, 0.5, 60.0))]
    png = plot_curves([{"init": "ours", "lr": 1e-3, "curve": curve}], tmp_path / "proxy.png", teacher_ppl=40.0)
    assert_chart(png)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("teacher") / "llama", num_layers=2)


def test_ild_stage_trains_exports_and_skips_when_done(tmp_path, teacher_dir):
    alpaca = demo_file("alpaca_en_demo.json")
    env = subprocess_env()
    init = subprocess.run([sys.executable, "-m", "upcycle.cli", "init", "--teacher", str(teacher_dir), "--out",
                           str(tmp_path / "init"), "--kv-lora-rank", "32", "--qk-rope-head-dim", "8",
                           "--calib-tokens", "0"],
                          cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-2000:]
    student_dir = tmp_path / "init" / "mamba2_student"
    assert not list(student_dir.glob("*.py"))  # no code in an export by default
    assert "auto_map" not in json.loads((student_dir / "config.json").read_text())
    cmd = [sys.executable, "-m", "upcycle.cli", "ild", "--config", "configs/upcycle/smollm2_ild_cpu.yaml",
           f"teacher.path={teacher_dir}", f"student.path={tmp_path / 'init' / 'mamba2_student'}",
           f"data.path={tmp_path / 'data'}", f"data.sources=[{alpaca}]", "data.seq_len=32", "data.val_max_batches=1",
           "optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=4", "optim.lr=3e-3",
           f"run.output_dir={tmp_path / 'ild'}", "run.eval_interval=0", "run.save_interval=2", "run.progress=false",
           "run.remote_code=true"]  # the opt-in: final/ also carries hybrid_lm_auto.py and an auto_map
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads((tmp_path / "ild" / "final" / "stage.json").read_text())
    rows = [json.loads(l) for l in (tmp_path / "ild" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert result["steps"] == 4 and losses[-1] < losses[0]
    assert (tmp_path / "ild" / "final" / "hybrid_lm_auto.py").is_file()
    assert "auto_map" in json.loads((tmp_path / "ild" / "final" / "config.json").read_text())
    student = HybridForCausalLM.from_pretrained(tmp_path / "ild" / "final")
    before = HybridForCausalLM.from_pretrained(tmp_path / "init" / "mamba2_student")
    assert torch.equal(student.model.embed_tokens.weight, before.model.embed_tokens.weight)  # frozen
    assert not torch.equal(student.model.layers[0].mixer.in_proj.weight, before.model.layers[0].mixer.in_proj.weight)
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "already finished" in again.stdout


def test_ild_stage_missing_student_is_one_line(tmp_path, teacher_dir):
    proc = subprocess.run([sys.executable, "-m", "upcycle.cli", "ild", "--config", "configs/upcycle/smollm2_ild_cpu.yaml",
                           f"teacher.path={teacher_dir}", f"student.path={tmp_path / 'nope'}",
                           f"run.output_dir={tmp_path / 'x'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: student.path:")
