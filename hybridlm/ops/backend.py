"""Choose between flash-linear-attention's Triton kernels (GPU) and the project's torch path (CPU).

``backend`` is a runtime setting (``runtime.backend``, hybridlm/model/runtime.py): ``auto`` (Triton when the
tensor is on CUDA and fla imports, else torch), ``triton`` (required: error if impossible) or ``torch`` (forced,
e.g. to compare paths on GPU).
fla is imported lazily: importing it loads every op up front (10-26 s on a CPU machine).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from hybridlm.ops.triton_launch import interpreting
from hybridlm.ops.tuning import apply_shipped_tuning

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
        if not (x.is_cuda or interpreting()):
            raise RuntimeError("backend: 'triton' needs CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1); "
                               "use backend 'auto' or 'torch' on CPU")
        if not fla_available():
            raise RuntimeError("backend: 'triton' needs flash-linear-attention (pip install flash-linear-attention)")
    elif not (x.is_cuda and fla_available()):
        return False
    if x.is_cuda:
        apply_shipped_tuning(x.device)  # once per process: the shipped autotune results in Triton's cache
    return True


# A decode step's norms and activations cover a few rows; through fla's Triton wrappers each costs ~0.2 ms of
# host time (autograd Function, contiguity checks, the autotuner's lookup, the launch), several times the few
# torch ops that do the same work. Measured on an H200: 61 RMSNorms were 12 of the 49 ms of an eager decode
# step of the route's hybrid (benchmarks/decode_probe.py).
SMALL_CALL_ROWS = 256


def is_small_inference_call(x: torch.Tensor) -> bool:
    """Outside autograd, with at most ``SMALL_CALL_ROWS`` rows of ``x``'s last dim (a decode step)."""
    return not torch.is_grad_enabled() and x.numel() <= SMALL_CALL_ROWS * x.shape[-1]


class ScopedFlag:
    """A switch that ``with flag.on():`` turns on for the code run inside (a ContextVar: per thread and task)."""

    def __init__(self, name: str):
        self._var = contextvars.ContextVar(name, default=False)

    @contextlib.contextmanager
    def on(self):
        token = self._var.set(True)
        try:
            yield
        finally:
            self._var.reset(token)

    def active(self) -> bool:
        return self._var.get()


# Inside, small inference calls take the fused Triton kernels too. For a CUDA graph's capture and its warm-up (which
# must run the same kernels, to tune them outside the capture): a replay has no host-side launch cost, so one fused
# kernel is one node of the graph where the torch ops of a norm are four.
SMALL_CALLS_THROUGH_KERNELS = ScopedFlag("small_calls_through_kernels")
small_calls_through_kernels = SMALL_CALLS_THROUGH_KERNELS.on

# Inside, the model leaves each sublayer's residual add to the next norm (fla's norm takes the residual: one kernel
# where there were two). For a CUDA graph's capture too (hybridlm/model/modeling.py _forward_residual_adds_in_norms).
RESIDUAL_ADDS_IN_NORMS = ScopedFlag("residual_adds_in_norms")
residual_adds_in_norms = RESIDUAL_ADDS_IN_NORMS.on
residual_adds_in_norms_active = RESIDUAL_ADDS_IN_NORMS.active


def use_triton_elementwise(backend: str, x: torch.Tensor) -> bool:
    """:func:`use_triton` for the small fused kernels (norms, SwiGLU): under ``auto`` a small inference call
    takes the torch path, which launches faster (unless :func:`small_calls_through_kernels` is on); a forced
    ``triton`` backend keeps the kernels."""
    return use_triton(backend, x) and (backend != "auto" or SMALL_CALLS_THROUGH_KERNELS.active()
                                       or not is_small_inference_call(x))


# Where the project has its own Triton kernel for an op that fla also has, which one the Triton path runs: the
# project's (the default) or fla's. Process-wide switches (benchmarks.train_speed --conv-kernel / --norm-kernel /
# --loss-kernel) for measuring both. conv: hybridlm/ops/causal_conv.py against fla's causal_conv1d; norm:
# hybridlm/ops/rms_norm.py against fla's rms_norm (the plain and the residual-add RMSNorm) and
# hybridlm/ops/gated_norm.py against fla's gated norms (Mamba2's grouped one; GDN's per-head one with its SiLU gate,
# KDA's sigmoid gate stays fla's);
# loss: hybridlm/ops/cross_entropy.py against fla's fused cross-entropy.
KERNEL_SOURCES = ("project", "fla")
_kernel_source = {"conv": "project", "norm": "project", "loss": "project"}


def set_kernel_source(op: str, source: str) -> None:
    if op not in _kernel_source:
        raise ValueError(f"kernel switch: op must be one of {sorted(_kernel_source)}, got {op!r}")
    if source not in KERNEL_SOURCES:
        raise ValueError(f"{op} kernel must be one of {KERNEL_SOURCES}, got {source!r}")
    _kernel_source[op] = source


def kernel_source(op: str) -> str:
    return _kernel_source[op]
