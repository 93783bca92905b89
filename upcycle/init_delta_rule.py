"""Initialise a Gated DeltaNet or KDA mixer from a Llama attention (the MambaInLlama mapping).

Shapes of :func:`upcycle.student.delta_rule_args`: n_h heads of d_h for q, k and v. q_proj <- W_q, k_proj /
v_proj <- W_k / W_v with each kv head repeated across its GQA group, o_proj <- W_o; the rest (convs, beta, decay
and output gates) keeps its default init, the decay parameters and output-norm weight re-drawn by the layer's
initialisers.
"""
from __future__ import annotations

import torch

from upcycle.init_copy import copy_into, expect, repeat_kv_rows
from upcycle.teacher_attention import attention_shapes, attention_weights


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
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if getattr(mixer, name).bias is not None:
            raise ValueError(f"{kind} init from attention: {name} has a bias, expected none")
    copy_into(mixer.q_proj.weight, w["q"])
    copy_into(mixer.k_proj.weight, repeat_kv_rows(w["k"], n_kv, n_h))
    copy_into(mixer.v_proj.weight, repeat_kv_rows(w["v"], n_kv, n_h))
    copy_into(mixer.o_proj.weight, w["o"])
    mixer.reset_recurrent_parameters()   # A_log, dt_bias
    mixer.o_norm_weight.fill_(1.0)
