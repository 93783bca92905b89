"""Hybrid configs of the students built from a Llama teacher: same width, MLPs, norms and vocabulary.

Every Llama decoder layer ``i`` becomes two sublayers of the hybrid: mixer ``2i`` (MLA, Mamba2, GDN, KDA or any
registered mixer, pre-normed by the layer's ``input_layernorm``) and SwiGLU MLP ``2i + 1``
(``post_attention_layernorm``). MLA gets the shapes of its SVD init (:func:`mla_args`), every mixer upcycled from
attention the shapes its own ``student_args`` gives (its registry entry's ``from_attention``,
:mod:`upcycle.init_linear`); another registered mixer its default settings at the teacher's width.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridConfig
from hybridlm.model.registry import is_mixer, mixers, symbol_of
from upcycle.init_linear import from_attention, upcycling_kinds


def teacher_rope(cfg) -> Dict[str, Any]:
    """The rotary frequencies the teacher's attention uses: ``inv_freq`` (d_h / 2 floats, pair i rotates by
    position * inv_freq[i]), ``attention_scaling`` (transformers multiplies cos and sin by it, so every
    attention score is scaled by its square) and ``rope_type``. Read from transformers' own
    ``LlamaRotaryEmbedding`` (``ROPE_INIT_FUNCTIONS[rope_type]`` for scaled types), so llama3, linear, yarn,
    dynamic and longrope give the frequencies the teacher's forward uses at sequence lengths up to
    ``original_max_position_embeddings`` (dynamic and longrope change them beyond it)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    emb = LlamaRotaryEmbedding(cfg)
    return dict(inv_freq=[float(f) for f in emb.inv_freq.float()], attention_scaling=float(emb.attention_scaling),
                rope_type=str(getattr(emb, "rope_type", "default")))


def llama_shapes(cfg) -> Dict[str, Any]:
    """The dimensions the mappings need, from a transformers ``LlamaConfig``; ``rope`` is :func:`teacher_rope`."""
    n_h = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_h
    d_h = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_h
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    return dict(d=cfg.hidden_size, L=cfg.num_hidden_layers, n_h=n_h, n_kv=n_kv, d_h=d_h, ffn=cfg.intermediate_size,
                vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, theta=float(theta),
                tie=bool(getattr(cfg, "tie_word_embeddings", False)), rope=teacher_rope(cfg))


def pattern_for(layer_kinds: Sequence[str]) -> str:
    return "".join(symbol_of(k) + "-" for k in layer_kinds)


ROPE_INITS = ("frequency_matched", "published")


def _model_inv_freq(theta: float, qk_rope_head_dim: int):
    """The inverse frequencies the MLA layer computes from a base alone (hybridlm.model.layers.rope)."""
    return 1.0 / (theta ** (torch.arange(0, qk_rope_head_dim, 2, dtype=torch.float32) / qk_rope_head_dim))


def kept_inv_freq(s: Dict[str, Any], qk_rope_head_dim: int) -> List[float]:
    """The teacher inverse frequencies of the qk_rope_head_dim / 2 rotation pairs a ``frequency_matched`` MLA
    keeps."""
    return s["rope"]["inv_freq"][:qk_rope_head_dim // 2]


def rope_mismatch(s: Dict[str, Any], mla: Dict[str, Any], rel_tol: float = 1e-5) -> Dict[str, Any]:
    """How the student's rope pairs rotate against the teacher pairs they were taken from (``frequency_matched``):
    ``pairs`` kept, ``mismatched`` (relative frequency error above ``rel_tol``) and ``max_rel_err``."""
    qk_rope_head_dim = mla["qk_rope_head_dim"]
    want = torch.tensor(kept_inv_freq(s, qk_rope_head_dim), dtype=torch.float32)
    got = (torch.tensor(mla["rope_inv_freq"], dtype=torch.float32) if mla.get("rope_inv_freq")
           else _model_inv_freq(mla["rope_theta"], qk_rope_head_dim))
    err = ((got - want).abs() / want).tolist() if qk_rope_head_dim else []
    return {"pairs": qk_rope_head_dim // 2, "mismatched": sum(e > rel_tol for e in err),
            "max_rel_err": max(err, default=0.0)}


def mla_args(s: Dict[str, Any], q_lora_rank: int, kv_lora_rank: int, qk_rope_head_dim: int,
             rope_init: str = "frequency_matched") -> Dict[str, Any]:
    """MLA of the same heads: nope + rope dims = the teacher's head dim, v = head dim, no latent norms
    (they would break the exact linear path of the SVD init).

    ``frequency_matched`` (ours) keeps the teacher's qk_rope_head_dim / 2 highest-frequency rotation pairs as
    the rope dims, each rotating at the frequency the teacher's attention gives it. For an unscaled teacher the
    base theta^(qk_rope_head_dim / d_h) does that. A scaled teacher (``rope_scaling`` llama3, linear, yarn, ...)
    has frequencies no single base reproduces, so the layer gets them as ``rope_inv_freq`` (qk_rope_head_dim / 2
    floats); :func:`rope_mismatch` checks the result pair by pair. A teacher's ``attention_scaling`` is
    folded into the query weights by :func:`upcycle.init_mla.init_mla_from_attention`.
    ``published`` takes the first qk_rope_head_dim rows of each head with the teacher's base: those rows get
    re-paired and re-frequencied, as in the X-EcoMLA recipe."""
    if rope_init not in ROPE_INITS:
        raise ConfigError(f"rope_init: {rope_init!r} is not one of {', '.join(ROPE_INITS)}")
    if qk_rope_head_dim % 2 or not 0 <= qk_rope_head_dim <= s["d_h"]:
        raise ConfigError(f"qk_rope_head_dim: {qk_rope_head_dim} must be even and between 0 and the head dim "
                          f"{s['d_h']}")
    matched = bool(qk_rope_head_dim) and rope_init == "frequency_matched"
    args = dict(num_heads=s["n_h"], q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                qk_nope_head_dim=s["d_h"] - qk_rope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=s["d_h"],
                rope_theta=s["theta"] ** (qk_rope_head_dim / s["d_h"]) if matched else s["theta"],
                latent_norm=False, norm_eps=s["eps"])
    if matched and s["rope"]["rope_type"] != "default":
        args["rope_inv_freq"] = kept_inv_freq(s, qk_rope_head_dim)
    return args


def student_config(llama_cfg, layer_kinds: Sequence[str], *, kv_lora_rank: int, qk_rope_head_dim: int,
                   q_lora_rank: Optional[int] = None, rope_init: str = "frequency_matched") -> HybridConfig:
    """A :class:`HybridConfig` whose layer ``i`` uses mixer ``layer_kinds[i]`` (a registered kind); the
    MLA arguments are :func:`mla_args` of the ranks (``q_lora_rank`` None: the full ``n_heads * head_dim``)."""
    s = llama_shapes(llama_cfg)
    if len(layer_kinds) != s["L"]:
        raise ConfigError(f"layers: {len(layer_kinds)} kinds given for a teacher with {s['L']} layers")
    bad = [k for k in layer_kinds if not is_mixer(k)]
    if bad:
        raise ConfigError(f"layers: unknown mixer {bad[0]!r}; expected one of {', '.join(m.kind for m in mixers())}")
    q_lora_rank = q_lora_rank if q_lora_rank is not None else s["n_h"] * s["d_h"]
    linear = {kind: from_attention(kind).student_args(s) for kind in upcycling_kinds()}
    return HybridConfig(
        vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=s["ffn"],
        hybrid_override_pattern=pattern_for(layer_kinds), mixer=next((k for k in layer_kinds if k != "mla"), "mamba2"),
        mla=mla_args(s, q_lora_rank, kv_lora_rank, qk_rope_head_dim, rope_init), **linear, rms_norm_eps=s["eps"],
        tie_word_embeddings=s["tie"],
        bos_token_id=getattr(llama_cfg, "bos_token_id", None), eos_token_id=getattr(llama_cfg, "eos_token_id", None),
    )
