"""Initialise a Mamba2 mixer from a Llama attention (MambaInLlama, docs/upcycling_init.md).

Shapes of :func:`mamba2_args`: expand 1, d_inner = n_h d_h, d_xb = n_kv d_h, d_state = d_h,
n_groups = n_h. Attention's q / k / v / o play the roles of C / B / x / out: ``in_proj`` rows
``[z | x | B | C | dt]`` get x <- W_v, B <- W_k, C <- W_q; ``out_proj`` <- W_o. x and B keep the teacher's n_kv
heads; the layer repeats each across its GQA group after the conv (kv head j serves heads j*g .. j*g+g-1, exactly
Llama's ``repeat_kv``). The dt rows keep their default init; A_log = log U(1, 16), dt_bias = softplus^-1(dt) with
dt log-uniform in [1e-3, 1e-1] floored at 1e-4 and D = 1 are re-drawn by the layer's own initialisers. Unlike
MambaInLlama, the conv starts as the identity and (with ``gate_bias``) the gate as the constant 1, and
:mod:`upcycle.calibrate` then fits the gated norm's weight to the teacher's output scale: the published init is
worse than a uniform guess before training (docs/upcycling_init.md).

:data:`FROM_ATTENTION` is what the ``mamba2`` registry entry names (hybridlm/model/layers/mamba2.py).
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from upcycle.init_copy import copy_into, expect
from upcycle.init_linear import FromAttention
from upcycle.teacher_attention import attention_shapes, attention_weights

SILU_INVERSE_OF_ONE = 1.2784645  # silu(1.2784645) = 1.0


def mamba2_args(s: Dict[str, Any]) -> Dict[str, Any]:
    """MambaInLlama shapes: expand 1 (d_inner = n_h d_h), x / B at n_kv d_h repeated like GQA, d_state = d_h,
    one group per head (C has the query's n_h d_h channels); a gate bias so that the gate can start constant."""
    return dict(d_state=s["d_h"], head_dim=s["d_h"], n_groups=s["n_h"], expand=1, d_inner=s["n_h"] * s["d_h"],
                d_xb=s["n_kv"] * s["d_h"], conv_size=4, conv_bias=True, norm_eps=s["eps"], gate_bias=True)


def set_conv_identity(conv) -> None:
    """A depthwise causal kernel that passes the current token through unchanged (before the SiLU)."""
    conv.weight.zero_()
    conv.weight[:, -1] = 1.0
    if conv.bias is not None:
        conv.bias.zero_()


@torch.no_grad()
def init_mamba2_from_attention(mixer, attn) -> None:
    s = attention_shapes(attn)
    w = attention_weights(attn)
    n_h, n_kv, d_h = s["n_h"], s["n_kv"], s["d_h"]
    expect("mamba2", "hidden size", mixer.in_proj.in_features, s["d"])
    expect("mamba2", "head_dim", mixer.head_dim, d_h)
    expect("mamba2", "d_state", mixer.d_state, d_h)
    expect("mamba2", "num heads (d_inner / head_dim)", mixer.num_heads, n_h)
    expect("mamba2", "n_groups", mixer.n_groups, n_h)
    expect("mamba2", "d_xb", mixer.d_xb, n_kv * d_h)
    expect("mamba2", "B width before repetition", mixer.d_b, n_kv * d_h)
    for lin, name in ((mixer.in_proj, "in_proj"), (mixer.out_proj, "out_proj")):
        if lin.bias is not None:
            raise ValueError(f"mamba2 init from attention: {name} has a bias, expected none")
    z, x, b, c, dt = mixer.in_proj.weight.split(
        [mixer.d_inner, mixer.d_xb, mixer.d_b, mixer.n_groups * mixer.d_state, mixer.num_heads], dim=0)
    copy_into(x, w["v"])
    copy_into(b, w["k"])
    copy_into(c, w["q"])
    copy_into(mixer.out_proj.weight, w["o"])
    mixer.reset_recurrent_parameters()   # A_log, dt_bias, D
    mixer.norm_weight.fill_(1.0)         # upcycle.calibrate fits it to the teacher's output scale
    # A random conv kernel mixes each channel of x / B / C with its neighbours in time and a random z scrambles
    # the output direction; both made the copied attention useless (docs/upcycling_init.md). The conv starts
    # as the identity on the current token, the gate as the constant silu(z_bias) = 1 with z's weights zero.
    set_conv_identity(mixer.conv1d)
    if mixer.z_bias is not None:
        z.zero_()
        mixer.z_bias.fill_(SILU_INVERSE_OF_ONE)


FROM_ATTENTION = FromAttention(student_args=mamba2_args, init=init_mamba2_from_attention)
