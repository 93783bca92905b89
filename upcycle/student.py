"""Hybrid configs of the students built from a Llama teacher: same width, MLPs, norms and vocabulary.

Every Llama decoder layer ``i`` becomes two sublayers of the hybrid: mixer ``2i`` (MLA, Mamba2, GDN or
KDA, pre-normed by the layer's ``input_layernorm``) and SwiGLU MLP ``2i + 1`` (``post_attention_layernorm``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridConfig
from hybridlm.model.pattern import MIXER_SYMBOL

STUDENT_KINDS = ("mla", "mamba2", "gdn", "kda")


def llama_shapes(cfg) -> Dict[str, Any]:
    """The dimensions the mappings need, from a transformers ``LlamaConfig``."""
    n_h = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_h
    d_h = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_h
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    if rope.get("rope_type", "default") not in ("default", None):
        theta = rope.get("rope_theta", theta)  # scaled RoPE variants keep their base; scaling is not reproduced
    return dict(d=cfg.hidden_size, L=cfg.num_hidden_layers, n_h=n_h, n_kv=n_kv, d_h=d_h, ffn=cfg.intermediate_size,
                vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, theta=float(theta),
                tie=bool(getattr(cfg, "tie_word_embeddings", False)))


def pattern_for(layer_kinds: Sequence[str]) -> str:
    return "".join(("*" if k == "mla" else MIXER_SYMBOL[k]) + "-" for k in layer_kinds)


ROPE_INITS = ("frequency_matched", "published")


def mla_args(s: Dict[str, Any], q_lora_rank: int, kv_lora_rank: int, rope_dim: int,
             rope_init: str = "frequency_matched") -> Dict[str, Any]:
    """MLA of the same heads: nope + rope dims = the teacher's head dim, v = head dim, no latent norms
    (they would break the exact linear path of the SVD init).

    ``frequency_matched`` (ours) keeps the teacher's rope_dim/2 highest-frequency rotation pairs as the
    rope dims and sets the base to theta^(rope_dim / d_h), so pair i rotates exactly like teacher pair i.
    ``published`` takes the first rope_dim rows of each head with the teacher's base: those rows get
    re-paired and re-frequencied, as in the X-EcoMLA recipe."""
    if rope_init not in ROPE_INITS:
        raise ConfigError(f"rope_init: {rope_init!r} is not one of {', '.join(ROPE_INITS)}")
    if rope_dim % 2 or not 0 <= rope_dim <= s["d_h"]:
        raise ConfigError(f"rope_dim: {rope_dim} must be even and between 0 and the head dim {s['d_h']}")
    return dict(num_heads=s["n_h"], q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                qk_nope_head_dim=s["d_h"] - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=s["d_h"],
                rope_theta=s["theta"] ** (rope_dim / s["d_h"]) if rope_dim and rope_init == "frequency_matched"
                else s["theta"],
                latent_norm=False, norm_eps=s["eps"])


def mamba2_args(s: Dict[str, Any]) -> Dict[str, Any]:
    """MambaInLlama shapes: expand 1 (d_inner = n_h d_h), x / B at n_kv d_h repeated like GQA, d_state = d_h,
    one group per head (C has the query's n_h d_h channels); a gate bias so that the gate can start constant."""
    return dict(d_state=s["d_h"], head_dim=s["d_h"], n_groups=s["n_h"], expand=1, d_inner=s["n_h"] * s["d_h"],
                d_xb=s["n_kv"] * s["d_h"], conv_size=4, conv_bias=True, norm_eps=s["eps"], gate_bias=True)


def delta_rule_args(s: Dict[str, Any]) -> Dict[str, Any]:
    """GDN / KDA with the attention's heads: q, k and v all get n_h heads of d_h (the teacher's k and v
    rows repeated across each GQA group)."""
    return dict(num_heads=s["n_h"], head_dim=s["d_h"], num_v_heads=s["n_h"], head_v_dim=s["d_h"], norm_eps=s["eps"])


def student_config(llama_cfg, layer_kinds: Sequence[str], *, q_lora_rank: Optional[int] = None,
                   kv_lora_rank: int = 128, rope_dim: int = 32, rope_init: str = "frequency_matched") -> HybridConfig:
    """A :class:`HybridConfig` whose layer ``i`` uses mixer ``layer_kinds[i]`` (``mla | mamba2 | gdn | kda``)."""
    s = llama_shapes(llama_cfg)
    if len(layer_kinds) != s["L"]:
        raise ConfigError(f"layers: {len(layer_kinds)} kinds given for a teacher with {s['L']} layers")
    bad = [k for k in layer_kinds if k not in STUDENT_KINDS]
    if bad:
        raise ConfigError(f"layers: unknown mixer {bad[0]!r}; expected one of {', '.join(STUDENT_KINDS)}")
    q_lora_rank = q_lora_rank if q_lora_rank is not None else s["n_h"] * s["d_h"]
    return HybridConfig(
        vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=s["ffn"],
        hybrid_override_pattern=pattern_for(layer_kinds), mixer=next((k for k in layer_kinds if k != "mla"), "mamba2"),
        mla=mla_args(s, q_lora_rank, kv_lora_rank, rope_dim, rope_init), mamba2=mamba2_args(s),
        gdn=delta_rule_args(s), kda=delta_rule_args(s), rms_norm_eps=s["eps"], tie_word_embeddings=s["tie"],
        bos_token_id=getattr(llama_cfg, "bos_token_id", None), eos_token_id=getattr(llama_cfg, "eos_token_id", None),
    )
