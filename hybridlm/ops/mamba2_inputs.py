"""What Mamba2's SSD scan takes, made from the conv's outputs x, B and C and in_proj's ``dt``.

The scan is fla's simple GLA with q = C, k = dt * B and v = x per head, log-decay g = A * dt (A = -exp(A_log)),
so the groups of B and C (and with ``d_xb`` the fewer x channels) are broadcast over their heads, dt goes through
softplus and scales the keys. In eager mode that is a handful of element-wise kernels forward and as many
reductions backward; :func:`compiled_ssd_inputs` hands the same function to ``torch.compile`` so the CUDA training
path can run it as a few fused kernels (``runtime.compile_ssd_inputs``; measured with ``benchmarks.train_speed
--mamba2-compile-inputs``).
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch
import torch.nn.functional as F


def repeat_heads(t: torch.Tensor, groups: int, per_head: int, num_heads: int) -> torch.Tensor:
    """[B, T, groups * per_head] -> [B, T, num_heads, per_head], each group serving consecutive heads."""
    B, T, _ = t.shape
    t = t.view(B, T, groups, per_head)
    return t if groups == num_heads else t.repeat_interleave(num_heads // groups, dim=2)


def dt_scaled_keys(b: torch.Tensor, dt: torch.Tensor, d_state: int) -> torch.Tensor:
    """``dt * B`` per head, [B, T, H, N]. The SSD update ``h = exp(g) h + dt B x^T`` scales the outer product by
    dt, so dt can go onto B instead of x: broadcasting B's groups over their heads does the head repetition and
    the scaling in one product, and x enters the scan as it is. The product is in B's dtype (bf16 in training):
    the scan's kernel reads bf16 keys anyway, and an fp32 product would be an fp32 [tokens, H * N] tensor forward
    and backward."""
    Bsz, T, width = b.shape
    H = dt.shape[-1]
    groups = width // d_state
    scaled = b.view(Bsz, T, groups, 1, d_state) * dt.to(b.dtype).view(Bsz, T, groups, H // groups, 1)
    return scaled.reshape(Bsz, T, H, d_state)


def ssd_inputs(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor,
               A_log: torch.Tensor, head_dim: int, d_state: int, n_groups: int
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [B,T,H,P], c [B,T,H,N], k [B,T,H,N], g [B,T,H] fp32)`` from the conv's outputs ``x [B, T, d_xb]``,
    ``b [B, T, d_b]``, ``c [B, T, n_groups * N]`` (column blocks of one tensor or tensors of their own) and
    ``dt [B, T, H]`` (before softplus and its bias)."""
    H = dt.shape[-1]
    x = repeat_heads(x, x.shape[-1] // head_dim, head_dim, H)
    c = repeat_heads(c, n_groups, d_state, H)
    dt = F.softplus(dt.float() + dt_bias.float())
    g = -A_log.float().exp() * dt
    return x, c, dt_scaled_keys(b, dt, d_state), g


@functools.lru_cache(maxsize=None)
def compiled_ssd_inputs():
    """:func:`ssd_inputs` through ``torch.compile`` (one graph, static shapes: a training run has one shape)."""
    return torch.compile(ssd_inputs, fullgraph=True, dynamic=False)
