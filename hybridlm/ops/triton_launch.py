"""What the project's Triton kernels share at launch: the import of triton, their autotuning, row views of their
inputs, and how many persistent programs a backward that loops over row blocks gets."""
from __future__ import annotations

import os
from typing import Optional

import torch


def interpreting() -> bool:
    """Under Triton's interpreter (``TRITON_INTERPRET=1``: the CPU tests), which runs one fixed configuration."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def load_triton(kernel_globals: Optional[dict] = None):
    """``triton``, imported on first use; given a kernel module's ``globals()``, also binds its ``tl`` there
    (``triton.language``: the name the kernels' source reads when ``triton.jit`` compiles them).

    Every kernel module imports triton through here, on first use and never at module import: triton (as fla,
    which imports it: hybridlm/ops/backend.py) costs seconds to import and can fail on a machine without a GPU
    driver, while the torch path needs none of it. So each kernel module names ``tl = None`` at module level
    and its ``_kernels()`` calls ``load_triton(globals())`` before ``triton.jit``; on CPU the tests run the same
    kernels under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    import triton
    import triton.language
    if kernel_globals is not None:
        kernel_globals["tl"] = triton.language
    return triton


def autotuned(kernel, configs, key, prune=None):
    """``kernel`` autotuned over ``configs`` by ``key``, the winners kept on disk as fla keeps its own (Triton's
    ``cache_results``), so that hybridlm/training/kernel_cache.py carries them to a fresh machine too: without
    them each of the project's kernels compiles and times every configuration there first. ``prune(configs,
    named_args, **kwargs)``: the configurations a launch may take (Triton's ``early_config_prune``)."""
    return load_triton().autotune(configs, key=key, cache_results=True,
                                  prune_configs_by={"early_config_prune": prune} if prune else None)(kernel)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (a block that covers a dimension), without importing triton on the hot path."""
    return 1 << max(0, n - 1).bit_length()


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[R, C]`` without a copy where its rows are evenly strided (a GEMM's output or a slice of it is)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def persistent_programs(device: torch.device, rows: int, per_sm: int, shares: int = 1) -> int:
    """Programs of a backward that strides over row blocks and writes one row of fp32 partials per program:
    ``per_sm`` per SM, split over ``shares`` independent columns of the grid. Under the interpreter a few, so
    that each program's loop still strides."""
    if device.type != "cuda":
        return max(1, min(3, rows))
    return max(1, torch.cuda.get_device_properties(device).multi_processor_count * per_sm // shares)
