"""``upcycle plan``'s arithmetic against a direct computation on real (tiny) models, and the shipped Llama route
configs: they pass the route's own schemas, and their comments state the KV ratios and token budgets they hold."""
import re
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import REPO
from hybridlm.config.errors import ConfigError
from hybridlm.config.loader import load_config
from hybridlm.config.structured import build_dataclass
from hybridlm.kv_report import kv_report, load_teacher_config
from hybridlm.model import HybridForCausalLM
from smart_select.stage import SmartConfig
from upcycle.init_students import InitConfig
from upcycle.plan import (BF16, FP32, activation_bytes, activation_widths, forward_flops_per_token, load_route,
                          plan_route, student_kinds)
from upcycle.route import route_sections
from upcycle.stages import check_route, route_stage_sections
from upcycle.student import student_config

LLAMA_ROUTES = sorted((REPO / "configs" / "upcycle").glob("llama*.yaml"))
TEACHERS = {"llama3.2-1b": "llama-3.2-1b", "llama3.2-3b": "llama-3.2-3b", "llama3.1-8b": "llama-3.1-8b"}


def tiny_teacher_config(tie):
    return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=tie)


def tiny_route(ckpt=False, linear="mamba2"):
    optim = {"micro_batch_size": 2, "global_batch_size": 16, "max_steps": 10, "lr": 1e-4,
             "activation_checkpointing": ckpt}
    return {"init": {"q_lora_rank": 48, "kv_lora_rank": 24, "qk_rope_head_dim": 8, "calib_tokens": 128,
                     "linear_mixer": linear},
            "ild": {"data": {"path": "ild_data", "seq_len": 32}, "optim": dict(optim)},
            "smart": {"n_mla": 2, "batches": 2, "batch_size": 2},
            "kd": {"data": {"format": "packed", "path": "ild_data", "seq_len": 32}, "kd": {"chunk_tokens": 16},
                   "optim": dict(optim)},
            "dpo": {"data": {"path": "pairs.json", "max_length": 24, "max_prompt_length": 12}, "optim": dict(optim)}}


def direct(cfg, kinds):
    model = HybridForCausalLM(student_config(cfg, kinds, q_lora_rank=48, kv_lora_rank=24, qk_rope_head_dim=8))
    layers = sum(p.numel() for p in model.model.layers.parameters())
    return model, sum(p.numel() for p in model.parameters()), layers


@pytest.mark.parametrize("tie,linear", [(True, "mamba2"), (False, "mamba2"), (True, "gdn"), (False, "kda")])
def test_plan_bytes_match_a_direct_computation(tie, linear):
    cfg, ranks = tiny_teacher_config(tie), 4
    plan = plan_route(tiny_route(linear=linear), cfg, ranks)
    plans = {p.name: p for p in plan.stages}
    assert list(plans) == ["init", "ild_mla", f"ild_{linear}", "smart", "kd", "dpo"]
    teacher = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    L, d, V = 4, 64, 300
    for kind in ("mla", linear):
        model, total, layers = direct(cfg, [kind] * L)
        got = plans[f"ild_{kind}"].bytes
        assert got["teacher weights (bf16)"] == 2 * teacher
        assert got["student weights (bf16)"] == 2 * total
        assert got["gradients (bf16 + fp32 accumulator)"] == (2 + 4) * layers  # embeddings and head frozen
        assert got["master + Adam (fp32, ZeRO-1)"] == -(-12 * layers // ranks)
        assert got["teacher trace / logits"] == 2 * 3 * L * (2 * 32) * d
        assert got["activations"] == activation_bytes(model.config, [kind] * L, 2 * 32, False)
        assert plans[f"ild_{kind}"].total == sum(got.values())
        assert plans[f"ild_{kind}"].tokens == 10 * 16 * 32
    hybrid, total, _ = direct(cfg, student_kinds(L, 2, linear))
    kd, dpo = plans["kd"].bytes, plans["dpo"].bytes
    assert kd["gradients (bf16 + fp32 accumulator)"] == 6 * total and dpo["reference weights (bf16)"] == 2 * total
    assert kd["master + Adam (fp32, ZeRO-1)"] == -(-12 * total // ranks)
    assert kd["teacher trace / logits"] == 3 * 4 * 16 * V  # one 16-token chunk of fp32 logits, 3 copies
    assert dpo["teacher trace / logits"] == 10 * (2 * 2) * 24 * V  # 2 pairs = 4 sequences of 24 tokens
    assert plans["init"].bytes == {"teacher weights (fp32)": 4 * teacher,
                                   "student weights (fp32)": 4 * max(direct(cfg, [k] * L)[1] for k in ("mla", linear))}
    # the hybrid's mixers, per layer, from their registry entries
    assert [(m.kind, m.layers, m.seq_len, m.cache_per_token) for m in plan.mixers] == [("mla", 2, 32, 24 + 8),
                                                                                       (linear, 2, 32, 0)]
    assert plan.mixers[1].state_per_sequence > 0 and plan.mixers[0].state_per_sequence == 0


def test_the_align_stage_is_planned_between_smart_and_kd_with_only_the_mixers_trained():
    cfg, ranks = tiny_teacher_config(True), 2
    route = tiny_route()
    route["align"] = {"data": {"path": "ild_data", "seq_len": 32},
                      "optim": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 5, "lr": 1e-3}}
    plans = {p.name: p for p in plan_route(route, cfg, ranks).stages}
    assert list(plans) == ["init", "ild_mla", "ild_mamba2", "smart", "align", "kd", "dpo"]
    hybrid, total, _ = direct(cfg, student_kinds(4, 2, "mamba2"))
    mixers = sum(p.numel() for b in hybrid.model.layers if b.kind != "mlp" for p in b.mixer.parameters())
    got = plans["align"].bytes
    assert got["student weights (bf16)"] == 2 * total
    assert got["gradients (bf16 + fp32 accumulator)"] == 6 * mixers and 0 < mixers < total
    assert got["master + Adam (fp32, ZeRO-1)"] == -(-12 * mixers // ranks)
    assert got["teacher trace / logits"] == 2 * 3 * 4 * (2 * 32) * 64  # the teacher's 3 traces per layer
    assert plans["align"].tokens == 5 * 8 * 32


def test_activation_model_by_hand():
    cfg = student_config(tiny_teacher_config(True), ["mla", "mamba2"] * 2, q_lora_rank=48, kv_lora_rank=24,
                         qk_rope_head_dim=8)
    d, f, H = 64, 96, 4
    mla = 2 * d + 48 + H * 16 + 24 + 8 + H * (8 + 16) + 2 * H * 16 + H * 16 + 2 * H
    # MambaInLlama shapes: d_inner 64, d_xb 32, d_state 16, 4 heads of 16, 4 groups
    conv = 2 * 32 + 4 * 16
    mamba = 2 * d + (64 + conv + 4) + conv + 2 * 64 + 2 * 64 + 2 * 4 * 16 * 16 / 64
    assert activation_widths(cfg, "mla") == {"mixer": mla, "mlp": 2 * d + 3 * f}
    assert activation_widths(cfg, "mamba2") == {"mixer": mamba, "mlp": 2 * d + 3 * f}
    kinds = ["mla", "mamba2"] * 2
    layer = {"mla": mla + 2 * d + 3 * f, "mamba2": mamba + 2 * d + 3 * f}
    assert activation_bytes(cfg, kinds, 100, False) == int(100 * BF16 * 2 * (layer["mla"] + layer["mamba2"]))
    # checkpointing: each block's input, plus one block recomputed
    assert activation_bytes(cfg, kinds, 100, True) == int(100 * BF16 * (4 * d + max(layer.values())))


def test_delta_rule_activations_and_flops_by_hand():
    cfg = student_config(tiny_teacher_config(True), ["mla", "gdn", "kda", "gdn"], q_lora_rank=48, kv_lora_rank=24,
                         qk_rope_head_dim=8)
    d, f, H, K, C = 64, 96, 4, 16, 64  # GDN / KDA at the teacher's heads: 4 heads of 16 for q, k and v
    gdn = (2 * (3 * H * K)          # q, k, v before and after their convs
           + 2 * H * K + H + H      # q and k normalised, beta, the scalar decay gate
           + 3 * H * K              # the output gate, the recurrence output, the gated norm's output
           + 2 * H * K * K / C)     # fp32 chunk states
    kda = gdn - H + H * K + 2 * K   # the decay per key channel, and the two rank-16 gate bottlenecks
    assert activation_widths(cfg, "gdn") == {"mixer": 2 * d + gdn, "mlp": 2 * d + 3 * f}
    assert activation_widths(cfg, "kda") == {"mixer": 2 * d + kda, "mlp": 2 * d + 3 * f}
    T = 32
    attention = H * T * (16 + 16)
    delta_rule = H * (6 * C * K + 4 * C * K + C * C / 3 + 6 * K * K)
    assert forward_flops_per_token(cfg, ["mla", "gdn", "kda", "gdn"], 1000, T) == \
        pytest.approx(2 * 1000 + attention + 3 * delta_rule)


def test_overrides_pick_the_linear_student(tmp_path):
    path = tmp_path / "route.yaml"
    path.write_text(yaml.safe_dump(tiny_route()))
    route = load_route(path, ["init.linear_mixer=gdn", "smart.n_mla=1"])
    assert route["init"]["linear_mixer"] == "gdn" and route["smart"]["n_mla"] == 1 and route["init"]["kv_lora_rank"] == 24
    stages = [p.name for p in plan_route(route, tiny_teacher_config(True), 2).stages]
    assert stages == ["init", "ild_mla", "ild_gdn", "smart", "kd", "dpo"]


def test_plan_refuses_what_it_does_not_model():
    route = tiny_route()
    route["kd"]["optim"]["zero_stage"] = 2
    with pytest.raises(ConfigError, match="kd.optim: the plan models precision bf16 with zero_stage 1"):
        plan_route(route, tiny_teacher_config(True), 8)
    with pytest.raises(ConfigError, match="smart: the plan needs n_mla"):
        plan_route({**tiny_route(), "smart": {}}, tiny_teacher_config(True), 8)
    # the route's own schemas: a key the route would refuse, the plan refuses too
    with pytest.raises(ConfigError, match="init: unknown key 'kv_rank'"):
        plan_route({**tiny_route(), "init": {"kv_rank": 24}}, tiny_teacher_config(True), 8)


@pytest.mark.parametrize("path", LLAMA_ROUTES, ids=lambda p: p.stem)
def test_llama_routes_pass_the_route_schema_and_state_their_numbers(path):
    assert len(LLAMA_ROUTES) == 4
    cfg = load_config(str(path), [], sections=route_sections())
    init = build_dataclass(InitConfig, cfg["init"], "init")
    smart = build_dataclass(SmartConfig, cfg["smart"], "smart")
    out = cfg["output_dir"]
    built = check_route(route_stage_sections(cfg, Path(out), cfg["teacher"]))
    for stage in ("ild", "kd", "dpo"):
        built[stage]["optim"].gradient_accumulation_steps(8)
    text = path.read_text()
    teacher = load_teacher_config(REPO / "configs" / "llama" / f"{TEACHERS[path.stem.split('_')[0]]}.json")
    L = teacher.num_hidden_layers
    assert f"into {smart.n_mla} MLA + {L - smart.n_mla} Mamba2 layers" in text
    kv = kv_report(teacher, range(smart.n_mla), init.kv_lora_rank, init.qk_rope_head_dim)
    assert f"ratio {100 * kv['ratio']:.2f}%, compression {kv['compression']:.1f}x" in text
    for stage, cfg_stage in (("ILD", built["ild"]), ("KD", built["kd"])):
        o = cfg_stage["optim"]
        tokens = o.max_steps * o.global_batch_size * cfg_stage["data"].seq_len
        assert re.search(rf"#   {stage} +{o.max_steps:,} steps = {tokens / 1e9:.2f}B tokens", text), stage
    assert yaml.safe_load(text)["teacher"].startswith("models/Llama-3.")
