"""The ``align`` stage (distill/align.py): its loss against a direct computation, zero for a student that is the
teacher, and the stage on a composed tiny hybrid: its own loss falls, only the mixers move."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import REPO, demo_file, subprocess_env
from distill.align import AlignConfig, align_loss, layer_distance
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass
from hybridlm.model import HybridForCausalLM


def _upcycle(root, n_kv, rope, layers=2):
    """A tiny random Llama with the real Llama-3.2 tokenizer and its two students (`upcycle init`)."""
    from hybridlm.data import load_tokenizer
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=n_kv, head_dim=16, vocab_size=len(tok), tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    init = subprocess.run([sys.executable, "-m", "upcycle.cli", "init", "--teacher", str(root / "teacher"), "--out",
                           str(root / "init"), "--kv-lora-rank", "32", "--qk-rope-head-dim", str(rope),
                           "--calib-tokens", "0"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert init.returncode == 0, init.stderr[-2000:]
    return root


def test_layer_distance_is_the_relative_squared_error_or_one_minus_cosine():
    g = torch.Generator().manual_seed(0)
    h, t = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    mse = sum(((h[b, i] - t[b, i]) ** 2).sum() for b in range(2) for i in range(5)) / sum(
        (t[b, i] ** 2).sum() for b in range(2) for i in range(5))
    assert layer_distance(h, t, "mse").item() == pytest.approx(mse.item(), rel=1e-6)
    cos = sum(1 - torch.dot(h[b, i], t[b, i]) / (h[b, i].norm() * t[b, i].norm()) for b in range(2) for i in range(5))
    assert layer_distance(h, t, "cosine").item() == pytest.approx(cos.item() / 10, rel=1e-5)
    assert layer_distance(t, t, "mse").item() == 0.0


def test_a_student_that_is_the_teacher_has_zero_alignment_loss(tmp_path):
    """One KV head, every head dim rotating, full ranks: `upcycle init`'s MLA student reproduces the teacher, so
    both streams give ~0; the Mamba2 student does not."""
    from hybridlm.teacher import load_teacher
    root = _upcycle(tmp_path, n_kv=1, rope=16)
    teacher = load_teacher(str(root / "teacher")).eval()
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    exact = HybridForCausalLM.from_pretrained(root / "init" / "mla_student")
    linear = HybridForCausalLM.from_pretrained(root / "init" / "mamba2_student")
    with torch.no_grad():
        for stream in ("student", "teacher"):
            for loss in ("mse", "cosine"):
                assert align_loss(exact, teacher, ids, loss, stream)[0].item() < 1e-6
                assert align_loss(linear, teacher, ids, loss, stream)[0].item() > 1e-3
        # the first layer reads the embeddings in both streams; later layers read their own stream or the teacher's
        _, free = align_loss(linear, teacher, ids, "mse", "student")
        _, forced = align_loss(linear, teacher, ids, "mse", "teacher")
        assert forced["first_layer"].item() == pytest.approx(free["first_layer"].item(), rel=1e-5)
        assert forced["last_layer"].item() != pytest.approx(free["last_layer"].item(), rel=1e-3)


def test_align_settings_are_checked():
    with pytest.raises(ConfigError, match=r"align.loss: expected one of 'mse', 'cosine', got 'l1'"):
        build_dataclass(AlignConfig, {"loss": "l1"}, "align")
    with pytest.raises(ConfigError, match=r"align.train: expected a non-empty list of inherited, mixer, latent"):
        build_dataclass(AlignConfig, {"train": ["mixers"]}, "align")


def test_align_stage_lowers_its_loss_and_moves_only_the_mixers(tmp_path):
    root = _upcycle(tmp_path, n_kv=2, rope=8)
    env = subprocess_env()
    compose = subprocess.run([sys.executable, "-m", "upcycle.cli", "compose", "--mla-student",
                              str(root / "init" / "mla_student"), "--linear-student",
                              str(root / "init" / "mamba2_student"), "--mla-layers", "0", "--out",
                              str(root / "hybrid")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert compose.returncode == 0, compose.stderr[-2000:]
    demo_file("alpaca_en_demo.json")
    run = subprocess.run([sys.executable, "-m", "upcycle.cli", "align", "--config",
                          "configs/upcycle/smollm2_align_cpu.yaml", f"teacher.path={root / 'teacher'}",
                          f"student.path={root / 'hybrid'}", f"data.path={root / 'data'}", "data.seq_len=32",
                          "data.val_max_batches=2", "optim.micro_batch_size=2", "optim.global_batch_size=2",
                          "optim.max_steps=6", "optim.warmup_steps=0", "optim.lr=3e-3", "run.eval_interval=3",
                          "run.save_interval=3", "run.progress=false", f"run.output_dir={root / 'align'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(l) for l in (root / "align" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0]  # validation alignment loss after 3 and after 6 steps
    train = [r for r in rows if "loss" in r]
    assert all({"first_layer", "last_layer", "worst_layer"} <= set(r) for r in train)
    stage = json.loads((root / "align" / "final" / "stage.json").read_text())
    assert stage["stage"] == "align" and stage["config"]["align"] == {"loss": "mse", "stream": "student",
                                                                      "train": ["mixer", "latent"]}
    before = HybridForCausalLM.from_pretrained(root / "hybrid")
    after = HybridForCausalLM.from_pretrained(root / "align" / "final")
    for (name, p), q in zip(before.named_parameters(), after.parameters()):
        moved = not torch.equal(p, q)
        assert moved == (".mixer." in name and name.split(".")[2] in ("0", "2")), name  # MLA 0, Mamba2 2: mixers
