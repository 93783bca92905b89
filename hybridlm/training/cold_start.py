"""What a fresh GPU machine does during the first training step, said while it happens.

On CUDA the first step of each new shape compiles fla's Triton kernels and autotunes them: minutes on a
fresh machine (4 to 6 for the 300M GDN / KDA models, 150 s for the upcycled Mamba2 student; BENCHMARKS.md,
"Cold start"), with nothing on screen. Triton keeps compiled kernels and autotune results in its cache directory,
so a later run on the same machine starts in seconds, and a fresh machine handed the autotune results
(:mod:`hybridlm.training.kernel_cache`) in about 17 s instead of 147 (GDN-300M on an H200).
"""
from __future__ import annotations

from typing import Optional

import torch

from hybridlm.ops import tuning
from hybridlm.ops.tuning import apply_shipped_tuning, triton_cache_dir


def first_step_notice(device: torch.device) -> Optional[str]:
    """The line to print before the first step on ``device``; None on CPU (nothing compiles there)."""
    if device.type != "cuda":
        return None
    tuning = apply_shipped_tuning(device, quiet=True)
    shipped = f"{tuning.line}; " if tuning is not None else ""
    cache = triton_cache_dir()
    warm = cache.is_dir() and any(cache.iterdir())
    state = f"the cache {cache} has entries, so this may be quick" if warm else \
        f"the cache {cache} is empty: expect minutes on a fresh machine"
    return (f"first step: compiling and autotuning fla's Triton kernels for these shapes ({shipped}{state}; "
            f"set TRITON_CACHE_DIR to a kept directory to reuse the results in later runs, or carry them to a "
            f"fresh machine with `python -m hybridlm.training.kernel_cache export / import`)")


def first_step_done(device: torch.device, seconds: float) -> Optional[str]:
    """The line to print after the first step; None on CPU."""
    if device.type != "cuda":
        return None
    shipped = tuning.status()
    served = f"; {shipped.served()}" if shipped is not None and shipped.served() else ""
    return (f"first step done in {seconds:.1f} s (compilation and autotuning included{served}); the steady rate "
            "follows")
