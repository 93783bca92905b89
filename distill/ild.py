"""Intermediate Layer Distillation: every student layer learns its teacher layer, teacher-forced.

Student layer i (mixer sublayer 2i + MLP sublayer 2i+1) reads the *teacher's* input hidden state of
layer i, so errors never compound across layers. The loss sums over layers the token-mean unsquared L2
distance of the layer outputs plus the same on the mixer (attention-replacement) outputs.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch


@torch.no_grad()
def teacher_trace(teacher, input_ids: torch.LongTensor) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per decoder layer of a transformers Llama: (input hidden, attention output, layer output)."""
    records: List[Dict[str, torch.Tensor]] = [dict() for _ in teacher.model.layers]
    handles = []

    def grab_input(i):
        def hook(module, args, kwargs):
            records[i]["x"] = args[0] if args else kwargs["hidden_states"]
        return hook

    def grab_output(i, key):
        def hook(module, args, output):
            records[i][key] = output[0] if isinstance(output, tuple) else output
        return hook

    for i, layer in enumerate(teacher.model.layers):
        handles.append(layer.register_forward_pre_hook(grab_input(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(grab_output(i, "y")))
        handles.append(layer.self_attn.register_forward_hook(grab_output(i, "a")))
    try:
        teacher.model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [(r["x"], r["a"], r["y"]) for r in records]


def ild_loss(student, teacher, input_ids: torch.LongTensor) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Sum over layers of mean_t ||y_s - y_t|| + mean_t ||a_s - a_t|| (student blocks fed teacher inputs)."""
    blocks = student.model.layers
    trace = teacher_trace(teacher, input_ids)
    if len(blocks) != 2 * len(trace):
        raise ValueError(f"ild: student has {len(blocks)} sublayers, teacher {len(trace)} layers (expected 2 per layer)")
    total = 0.0
    out_sum, mix_sum = 0.0, 0.0
    dtype = next(student.parameters()).dtype
    for i, (x, a, y) in enumerate(trace):
        mixer_block, mlp_block = blocks[2 * i], blocks[2 * i + 1]
        x, a, y = x.to(dtype), a.to(dtype), y.to(dtype)
        a_s = mixer_block.mixer(mixer_block.norm(x))
        y_s = mlp_block(x + a_s)
        out_term = (y_s - y).float().norm(dim=-1).mean()
        mix_term = (a_s - a).float().norm(dim=-1).mean()
        total = total + out_term + mix_term
        out_sum += out_term.detach()
        mix_sum += mix_term.detach()
    n = len(trace)
    return total, {"layer_l2": out_sum / n, "mixer_l2": mix_sum / n}
