"""Choose between flash-linear-attention's Triton kernels (GPU) and the project's torch path (CPU).

``backend`` is a config key: ``auto`` (Triton when the tensor is on CUDA and fla imports, else torch),
``triton`` (required: error if impossible) or ``torch`` (forced, e.g. to compare paths on GPU).
fla is imported lazily: importing it loads every op up front (10-26 s on a CPU machine).
"""
from __future__ import annotations

import functools

import torch

BACKENDS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    try:
        import fla  # noqa: F401
    except Exception:  # ImportError, or triton failing to find a driver
        return False
    return True


def use_triton(backend: str, x: torch.Tensor) -> bool:
    """Whether ``x`` should go through the Triton kernels under the configured ``backend``."""
    if backend == "torch":
        return False
    if backend == "triton":
        if not x.is_cuda:
            raise RuntimeError("backend: 'triton' needs CUDA tensors; use backend 'auto' or 'torch' on CPU")
        if not fla_available():
            raise RuntimeError("backend: 'triton' needs flash-linear-attention (pip install flash-linear-attention)")
        return True
    return x.is_cuda and fla_available()
