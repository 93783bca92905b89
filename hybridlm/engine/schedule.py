"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr``, then constant.

With ``s`` the number of optimizer updates already applied (0 for the first update), ``W`` the
warmup steps, ``T`` = ``max_steps``, the learning rate used by update ``s`` is::

    lr(s) = lr * (s + 1) / W                                      if s < W
    lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2   if W <= s < T
    lr(s) = min_lr                                                 if s >= T

so the first update already gets ``lr / W`` (not 0), update ``W - 1`` gets the peak ``lr``, and
update ``T`` onward gets ``min_lr``.  ``lr_lambda`` returns ``lr(s) / lr``, the multiplicative
factor ``torch.optim.lr_scheduler.LambdaLR`` expects.  The scheduler advances only on applied
updates: a step skipped for a non-finite loss does not consume schedule.
"""
from __future__ import annotations

import math
from typing import Callable


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """The learning rate for the update that follows ``step`` applied updates (formula above)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_lambda(*, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> Callable[[int], float]:
    """``LambdaLR`` factor function: ``lambda step: lr_at(step) / lr``."""

    def factor(step: int) -> float:
        return lr_at(step, lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, max_steps=max_steps) / lr

    return factor


def lr_lambda_from_config(cfg) -> Callable[[int], float]:
    """:func:`lr_lambda` for an :class:`~hybridlm.engine.config.OptimConfig`."""
    return lr_lambda(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps)
