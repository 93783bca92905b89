"""Choose between flash-linear-attention's Triton kernels (GPU) and the project's torch path (CPU).

``backend`` is a runtime setting (``runtime.backend``, hybridlm/model/runtime.py): ``auto`` (Triton when the
tensor is on CUDA and fla imports, else torch), ``triton`` (required: error if impossible) or ``torch`` (forced,
e.g. to compare paths on GPU).
fla is imported lazily: importing it loads every op up front (10-26 s on a CPU machine).
The functions here only answer: the shipped kernel tuning is put in place when a model is built
(hybridlm/ops/tuning.py ``install_shipped_tuning``), before any kernel launches.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from hybridlm.ops.triton_launch import interpreting

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
    return True


# A decode step's norms and activations cover a few rows; through fla's Triton wrappers each costs host time
# (autograd Function, contiguity checks, the autotuner's lookup, the launch), several times the few torch ops
# that do the same work: in an eager decode step of the route's hybrid its 61 RMSNorms take about a quarter of
# the step (benchmarks/decode_probe.py; the eager step: BENCHMARKS.md, "The decode fast path: what each piece
# is worth").
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


# ``runtime.graph_small_kernels`` (hybridlm/model/runtime.py) applied to a captured CUDA-graph decode step:
# hybridlm/model/graphs.py ``GraphedDecoder.kernel_choices`` turns it on for the step's warm-up and capture (which
# must run the same kernels) when the setting is on. Inside, small inference calls take the fused Triton kernels
# too (:func:`use_triton_elementwise`): a replay has no host-side launch cost, so one fused kernel is one graph node
# where the torch ops of a norm are four.
SMALL_CALLS_THROUGH_KERNELS = ScopedFlag("small_calls_through_kernels")
small_calls_through_kernels = SMALL_CALLS_THROUGH_KERNELS.on

# ``runtime.graph_fuse_residual`` (hybridlm/model/runtime.py) applied to a captured CUDA-graph decode step:
# hybridlm/model/graphs.py ``GraphedDecoder.kernel_choices`` turns it on for the step's warm-up and capture when the
# setting is on. Inside, the model outside training leaves each sublayer's residual add to the next norm (one
# kernel instead of an add and a norm: hybridlm/model/modeling.py ``_forward_residual_adds_in_norms``); in training
# ``runtime.fuse_residual_norm`` decides.
RESIDUAL_ADDS_IN_NORMS = ScopedFlag("residual_adds_in_norms")
residual_adds_in_norms = RESIDUAL_ADDS_IN_NORMS.on
residual_adds_in_norms_active = RESIDUAL_ADDS_IN_NORMS.active


def use_triton_elementwise(backend: str, x: torch.Tensor) -> bool:
    """:func:`use_triton` for the small fused kernels (norms, SwiGLU): under ``auto`` a small inference call
    takes the torch path, which launches faster (unless :func:`small_calls_through_kernels` is on); a forced
    ``triton`` backend keeps the kernels."""
    return use_triton(backend, x) and (backend != "auto" or SMALL_CALLS_THROUGH_KERNELS.active()
                                       or not is_small_inference_call(x))
