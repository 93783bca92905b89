"""What the project's Triton kernels share at launch: their autotuning, row views of their inputs, and how many
persistent programs a backward that loops over row blocks gets."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Under Triton's interpreter (``TRITON_INTERPRET=1``: the CPU tests), which runs one fixed configuration."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotuned(kernel, configs, key, prune=None):
    """``kernel`` autotuned over ``configs`` by ``key``, the winners kept on disk as fla keeps its own (Triton's
    ``cache_results``), so that hybridlm/training/kernel_cache.py carries them to a fresh machine too: without
    them each of the project's kernels compiles and times every configuration there first. ``prune(configs,
    named_args, **kwargs)``: the configurations a launch may take (Triton's ``early_config_prune``)."""
    import triton
    return triton.autotune(configs, key=key, cache_results=True,
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
