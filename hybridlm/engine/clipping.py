"""Gradient clipping by the global L2 norm, as a step pre-hook of the optimizer DeepSpeed wraps.

DeepSpeed's bf16 optimizer (``BF16_Optimizer``: ZeRO-1 with bf16 weights and fp32 gradient accumulation, the
engine's default) clips in a Python loop over every parameter's fp32 gradient, after reading the clip coefficient
on the host: a device sync and then ~250 tiny kernels that the GPU waits for one launch at a time, every step
(BENCHMARKS.md, "Training step breakdown"). That optimizer hands the optimizer it wraps
this rank's partition of the reduced fp32 gradients as one flat tensor per parameter group, and steps it once with all
groups. So for it the engine turns DeepSpeed's clipping off and clips those here: one norm per tensor, one
all-reduce of the sum of squares over the ranks (their partitions are disjoint), one multiply by
``min(1, max_norm / (norm + 1e-6))`` kept on the device. That is DeepSpeed's formula
(deepspeed/runtime/utils.py ``clip_tensors_by_global_norm``); multiplying by exactly 1 changes nothing.
DeepSpeed's ZeRO optimizer (the other precisions, ZeRO-2) already clips its flat partitions in a few kernels, and
steps the wrapped optimizer one parameter group at a time, so a hook there would see part of the norm: the
engine leaves its clipping to DeepSpeed.

DeepSpeed still computes its own norm first: it is the step's reported gradient norm, and a non-finite one skips
the step before the wrapped optimizer (and so this hook) runs (hybridlm/engine/step_runner.py, module docstring). The
engine hands the hook that norm rather than taking it twice. DeepSpeed takes one norm per parameter's gradient
(~110 small kernels a GDN-300M step, and as many launches);
:meth:`~hybridlm.engine.deepspeed_adapter.DeepSpeedAdapter.norm_over_flat_gradients` hands it the flat buffers
those gradients live in instead. Every reach into DeepSpeed's optimizer is hybridlm/engine/deepspeed_adapter.py's;
this module is plain torch.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

EPS = 1e-6


def partition_grads(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The gradients of the optimizer's parameters (under DeepSpeed: this rank's flat fp32 partitions)."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


@torch.no_grad()
def global_norm(grads: List[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                reference: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The L2 norm over every rank's share of the gradients (``grads`` is this rank's; the shares are disjoint),
    without a host sync. ``reference`` gives the device when ``grads`` is empty (a rank may own no trainable
    element; it still joins the all-reduce)."""
    sq = (torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).square().sum() if grads
          else torch.zeros((), dtype=torch.float32, device=reference.device))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt()


@torch.no_grad()
def scale_to_max_norm(grads: List[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` by ``min(1, max_norm / (norm + 1e-6))``, the coefficient kept on the device."""
    if grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + EPS), max=1.0).to(grads[0].dtype))


def clip_by_global_norm(grads: List[torch.Tensor], max_norm: float, group: Optional[dist.ProcessGroup] = None,
                        reference: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scale ``grads`` (this rank's share) so that the L2 norm over every rank's share is at most ``max_norm``;
    returns that norm (before clipping) without a host sync (:func:`global_norm`, :func:`scale_to_max_norm`)."""
    norm = global_norm(grads, group, reference)
    scale_to_max_norm(grads, norm, max_norm)
    return norm


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float, group: Optional[dist.ProcessGroup] = None,
                     norm: Optional[Callable[[], torch.Tensor]] = None):
    """Register clipping of ``optimizer``'s gradients to ``max_norm`` as its step pre-hook; returns the handle.
    ``norm()``, if given, returns their global norm already taken (DeepSpeed's, just before it steps the
    optimizer): it is not taken again."""
    if max_norm <= 0:
        raise ValueError(f"clip_before_step: max_norm must be > 0, got {max_norm}")

    def hook(opt, _args, _kwargs):
        grads = partition_grads(opt)
        if norm is None:
            clip_by_global_norm(grads, max_norm, group, opt.param_groups[0]["params"][0])
        else:
            scale_to_max_norm(grads, norm(), max_norm)

    return optimizer.register_step_pre_hook(hook)
