"""What a fresh GPU machine does during the first training step, said while it happens.

On CUDA the first step of each new shape compiles fla's Triton kernels and autotunes them: minutes on a
fresh machine (4 to 6 for the 300M GDN / KDA models, 150 s for the upcycled Mamba2 student; BENCHMARKS.md,
"Cold start"), with nothing on screen. Triton keeps compiled kernels and autotune results in its cache directory,
so a later run on the same machine starts in seconds, and a fresh machine handed the autotune results
(:mod:`hybridlm.training.kernel_cache`) in about 17 s instead of 147 (GDN-300M on an H200).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels and autotune results: ``TRITON_CACHE_DIR`` or its default."""
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".triton" / "cache"


def first_step_notice(device: torch.device) -> Optional[str]:
    """The line to print before the first step on ``device``; None on CPU (nothing compiles there)."""
    if device.type != "cuda":
        return None
    cache = triton_cache_dir()
    warm = cache.is_dir() and any(cache.iterdir())
    state = f"the cache {cache} has entries, so this may be quick" if warm else \
        f"the cache {cache} is empty: expect minutes on a fresh machine"
    return (f"first step: compiling and autotuning fla's Triton kernels for these shapes ({state}; "
            f"set TRITON_CACHE_DIR to a kept directory to reuse the results in later runs, or carry them to a "
            f"fresh machine with `python -m hybridlm.training.kernel_cache export / import`)")


def first_step_done(device: torch.device, seconds: float) -> Optional[str]:
    """The line to print after the first step; None on CPU."""
    if device.type != "cuda":
        return None
    return f"first step done in {seconds:.1f} s (compilation and autotuning included); the steady rate follows"
