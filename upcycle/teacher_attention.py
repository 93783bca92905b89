"""The weights and head shapes of a transformers Llama attention module, read for the students' init."""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from hybridlm.config.errors import ConfigError


# -------------------------------------------------------------------------------------- attention
def attention_weights(attn) -> Dict[str, torch.Tensor]:
    """W_q, W_k, W_v, W_o of a transformers Llama attention; refuses biases (no place for them)."""
    out = {}
    for n in "qkvo":
        lin = getattr(attn, f"{n}_proj", None)
        if not isinstance(lin, nn.Linear):
            raise ConfigError(f"teacher attention: no {n}_proj linear layer (expected a Llama attention module)")
        if lin.bias is not None:
            raise ConfigError(f"teacher attention: {n}_proj has a bias; the linear-mixer mapping expects "
                             f"bias-free projections (attention_bias false)")
        out[n] = lin.weight.detach()
    return out


def attention_shapes(attn) -> Dict[str, int]:
    """d, n_h, n_kv, d_h of a Llama attention module, read from its weights and ``head_dim``."""
    w = attention_weights(attn)
    d = w["q"].shape[1]
    d_h = getattr(attn, "head_dim", None)
    if d_h is None:
        cfg = getattr(attn, "config", None)
        d_h = getattr(cfg, "head_dim", None) or (cfg.hidden_size // cfg.num_attention_heads)
    if w["q"].shape[0] % d_h or w["k"].shape[0] % d_h or w["v"].shape != w["k"].shape:
        raise ValueError(f"teacher attention: q {tuple(w['q'].shape)}, k {tuple(w['k'].shape)}, "
                         f"v {tuple(w['v'].shape)} do not split into heads of {d_h}")
    n_h, n_kv = w["q"].shape[0] // d_h, w["k"].shape[0] // d_h
    if n_h % n_kv:
        raise ValueError(f"teacher attention: {n_h} query heads are not a multiple of {n_kv} kv heads")
    if tuple(w["o"].shape) != (d, n_h * d_h):
        raise ValueError(f"teacher attention: o_proj is {tuple(w['o'].shape)}, expected {(d, n_h * d_h)}")
    return dict(d=d, n_h=n_h, n_kv=n_kv, d_h=d_h)
