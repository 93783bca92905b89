"""Initialise a Gated DeltaNet or KDA mixer from a Llama attention (the MambaInLlama mapping, docs/upcycling_init.md).

Shapes of :func:`delta_rule_args`: n_h heads of d_h for q, k and v. q_proj <- W_q, k_proj /
v_proj <- W_k / W_v with each kv head repeated across its GQA group (kv head j serves query heads j*g .. j*g+g-1,
Llama's ``repeat_kv``), o_proj <- W_o; A_log / dt_bias are re-drawn by the layer's initialisers and the
output-norm weight starts at 1 (:mod:`upcycle.calibrate` then fits the output scale).

GDN (its students have ``gate_bias`` and ``beta_bias``) starts as gated linear attention over the teacher's
projections rather than as a scrambled copy of them: the q / k / v convs pass the current token through (the
SiLU after them stays), the output gate is the constant swish(g_bias) = 1 with g_proj's weights zero, beta is
the constant :data:`GDN_INIT_BETA` with b_proj's weights zero (a small beta makes the delta rule's erase term
small: close to additive linear attention) and the decay a constant per head (a_proj's weights zero, A_log and
dt_bias as drawn). Measured on SmolLM2 in docs/upcycling_init.md. KDA keeps the default init of everything but
q / k / v / o.

:data:`GDN_FROM_ATTENTION` and :data:`KDA_FROM_ATTENTION` are what the ``gdn`` and ``kda`` registry entries name
(hybridlm/model/layers/gated_deltanet.py, kda.py).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict

import torch

from upcycle.init_copy import copy_into, expect, repeat_kv_rows
from upcycle.init_linear import FromAttention
from upcycle.init_mamba2 import SILU_INVERSE_OF_ONE, set_conv_identity
from upcycle.teacher_attention import attention_shapes, attention_weights

GDN_INIT_BETA = 0.05  # sigmoid(b_bias) at init


def delta_rule_args(s: Dict[str, Any], biases: bool = False) -> Dict[str, Any]:
    """GDN / KDA with the attention's heads: q, k and v all get n_h heads of d_h (the teacher's k and v
    rows repeated across each GQA group); ``biases``: an output-gate and a beta bias, so that the gate and beta
    can start constant (GDN: :func:`start_as_linear_attention`)."""
    return dict(num_heads=s["n_h"], head_dim=s["d_h"], num_v_heads=s["n_h"], head_v_dim=s["d_h"], norm_eps=s["eps"],
                gate_bias=biases, beta_bias=biases)


@torch.no_grad()
def init_delta_rule_from_attention(mixer, attn, kind: str = "gdn") -> None:
    s = attention_shapes(attn)
    w = attention_weights(attn)
    n_h, n_kv, d_h = s["n_h"], s["n_kv"], s["d_h"]
    expect(kind, "hidden size", mixer.q_proj.in_features, s["d"])
    expect(kind, "num_heads", mixer.num_heads, n_h)
    expect(kind, "head_dim", mixer.head_k_dim, d_h)
    expect(kind, "num_v_heads", mixer.num_v_heads, n_h)
    expect(kind, "head_v_dim", mixer.head_v_dim, d_h)
    if kind == "gdn":
        expect(kind, "gate_bias", mixer.g_bias is not None, True)
        expect(kind, "beta_bias", mixer.b_bias is not None, True)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if getattr(mixer, name).bias is not None:
            raise ValueError(f"{kind} init from attention: {name} has a bias, expected none")
    copy_into(mixer.q_proj.weight, w["q"])
    copy_into(mixer.k_proj.weight, repeat_kv_rows(w["k"], n_kv, n_h))
    copy_into(mixer.v_proj.weight, repeat_kv_rows(w["v"], n_kv, n_h))
    copy_into(mixer.o_proj.weight, w["o"])
    mixer.reset_recurrent_parameters()   # A_log, dt_bias
    mixer.o_norm_weight.fill_(1.0)       # upcycle.calibrate fits the output scale
    if kind == "gdn":
        start_as_linear_attention(mixer)


@torch.no_grad()
def start_as_linear_attention(mixer, beta: float = GDN_INIT_BETA) -> None:
    """Identity q / k / v convs, the constant gate 1, the constant ``beta`` and a constant decay per head, in place
    (the GDN mixer needs ``g_bias`` and ``b_bias``). At fla's random init the convs mix each channel with its
    neighbours in time, the gate multiplies each channel by small noise of either sign and beta ~ 0.5 erases half
    the state along each key: the copied attention was then no better than a silent layer
    (docs/upcycling_init.md)."""
    for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
        set_conv_identity(conv)
    mixer.a_proj.weight.zero_()    # a per-head constant decay: -exp(A_log) * softplus(dt_bias) per token
    mixer.g_proj.weight.zero_()
    mixer.g_bias.fill_(SILU_INVERSE_OF_ONE)
    mixer.b_proj.weight.zero_()
    mixer.b_bias.fill_(math.log(beta / (1.0 - beta)))


GDN_FROM_ATTENTION = FromAttention(student_args=partial(delta_rule_args, biases=True),
                                   init=partial(init_delta_rule_from_attention, kind="gdn"))
KDA_FROM_ATTENTION = FromAttention(student_args=delta_rule_args,
                                   init=partial(init_delta_rule_from_attention, kind="kda"))
