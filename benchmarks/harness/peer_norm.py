"""transformers' Mamba2 peer with mamba_ssm's grouped gated RMSNorm, whatever transformers version is installed.

mamba_ssm's Mamba2 (and ours, ``hybridlm/model/layers/mamba2.py``) normalises ``y * silu(z)`` over groups of
``d_inner / n_groups`` channels. transformers' ``MambaRMSNormGated`` did so only from the release that gave it a
``group_size`` (5.24 has it); before (5.17 has not), it normalises over all ``d_inner`` channels at once: with
``n_groups > 1`` another function of the same weights. :func:`set_gated_norms` gives a peer's norms either
forward whatever transformers is installed: ``grouped`` (the architecture ours implements, the bench's default) or
``d_inner`` (what transformers before 5.24 computes: the loss-parity runs made with 5.17, docs/initialisation.md).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def grouped_gated_rms_norm(self, hidden_states: torch.Tensor, gate=None) -> torch.Tensor:
    """transformers' grouped ``MambaRMSNormGated.forward``: fp32 gate and statistics, ``self.group_size``
    channels a group, the result in the input's dtype times the weight."""
    dtype = hidden_states.dtype
    h = hidden_states.float()
    if gate is not None:
        h = h * F.silu(gate.float())
    *prefix, width = h.shape
    g = h.view(*prefix, width // self.group_size, self.group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * g.view(*prefix, width).to(dtype)


NORMS = ("grouped", "d_inner")


def set_gated_norms(model: nn.Module, kind: str) -> int:
    """Every Mamba2 mixer's gated norm of transformers' ``model`` over groups of ``intermediate_size / n_groups``
    channels (``grouped``) or over all of them (``d_inner``); returns how many mixers it found."""
    if kind not in NORMS:
        raise ValueError(f"gated norm {kind!r}: expected one of {', '.join(NORMS)}")
    found = 0
    for module in model.modules():
        norm = getattr(module, "norm", None)
        if not (hasattr(module, "n_groups") and hasattr(module, "intermediate_size") and norm is not None):
            continue
        norm.group_size = module.intermediate_size // (module.n_groups if kind == "grouped" else 1)
        norm.forward = types.MethodType(grouped_gated_rms_norm, norm)
        found += 1
    return found
