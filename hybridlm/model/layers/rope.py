"""Rotary position embedding on the decoupled RoPE dims (rotate-half pairing, as in HF Llama)."""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables ``[..., T, dim]`` for integer positions ``[T]`` or per sequence ``[B, T]``, in fp32."""
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
