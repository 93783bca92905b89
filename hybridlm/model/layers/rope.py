"""Rotary position embedding on the decoupled RoPE dims (rotate-half pairing, as in HF Llama)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch


_INV_FREQ: Dict[tuple, torch.Tensor] = {}


def inv_freq_tensor(values: Sequence[float], device) -> torch.Tensor:
    """``values`` as an fp32 tensor on ``device``, made once per (values, device): the eager prompt and warm-up
    steps make it, and a decode step captured in a CUDA graph reuses it (a host-to-device copy cannot be captured)."""
    key = (tuple(values), str(torch.device(device)))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = torch.tensor(key[0], dtype=torch.float32, device=device)
    return _INV_FREQ[key]


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float,
                 inv_freq: Optional[Sequence[float]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables ``[..., T, dim]`` for integer positions ``[T]`` or per sequence ``[B, T]``, in fp32.
    ``inv_freq`` (dim / 2 values) replaces the ``theta`` progression when given."""
    if inv_freq is not None:
        inv_freq = inv_freq_tensor(inv_freq, positions.device)
    else:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]``; cos / sin ``[T, D]`` (shared positions) or ``[B, T, D]`` (per sequence)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
