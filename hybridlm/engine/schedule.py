"""Learning-rate schedules: linear warmup, then ``cosine`` decay, ``wsd`` (warmup-stable-decay) or ``constant``.

With ``s`` the number of optimizer updates already applied (0 for the first update), ``W`` the warmup steps,
``T`` = ``max_steps``, ``D`` = the decay steps of ``wsd`` (``decay_fraction`` of ``T - W``, rounded up), the
learning rate used by update ``s`` is::

    lr(s) = lr * (s + 1) / W                                                  if s < W (every schedule)
    cosine:   lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2   if W <= s < T
    wsd:      lr(s) = lr                                                      if W <= s < T - D
              lr(s) = lr - (lr - min_lr) * (s - (T - D) + 1) / D              if T - D <= s < T
    constant: lr(s) = lr                                                      if W <= s < T
    lr(s) = min_lr for cosine and wsd, lr for constant                        if s >= T

so the first update already gets ``lr / W`` (not 0), update ``W - 1`` gets the peak ``lr``, and the last update
of ``wsd`` (``T - 1``) gets ``min_lr``. ``wsd`` holds the peak for most of a run and decays linearly at its end,
so a longer run does not spend its second half near the floor as cosine does (the warmup-stable-decay schedule
of MiniCPM and of hybrid-distillation's long stage). ``lr_lambda`` returns ``lr(s) / lr``, the factor
``torch.optim.lr_scheduler.LambdaLR`` expects. The scheduler advances only on applied updates: a step skipped
for a non-finite loss does not consume schedule.
"""
from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("cosine", "wsd", "constant")


def decay_steps(*, warmup_steps: int, max_steps: int, decay_fraction: float) -> int:
    """The steps over which ``wsd`` decays: ``decay_fraction`` of the post-warmup steps, at least one."""
    return max(1, math.ceil(decay_fraction * max(0, max_steps - warmup_steps)))


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str = "cosine",
          decay_fraction: float = 0.2) -> float:
    """The learning rate for the update that follows ``step`` applied updates (formulas above)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if step >= max_steps:
        return min_lr
    if schedule == "wsd":
        decay = decay_steps(warmup_steps=warmup_steps, max_steps=max_steps, decay_fraction=decay_fraction)
        into_decay = step - (max_steps - decay) + 1
        return lr if into_decay <= 0 else lr - (lr - min_lr) * into_decay / decay
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_lambda(*, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str = "cosine",
              decay_fraction: float = 0.2) -> Callable[[int], float]:
    """``LambdaLR`` factor function: ``lambda step: lr_at(step) / lr``."""

    def factor(step: int) -> float:
        return lr_at(step, lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, max_steps=max_steps, schedule=schedule,
                     decay_fraction=decay_fraction) / lr

    return factor


def lr_lambda_from_config(cfg) -> Callable[[int], float]:
    """:func:`lr_lambda` for an :class:`~hybridlm.engine.config.OptimConfig`."""
    return lr_lambda(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                     schedule=cfg.schedule, decay_fraction=cfg.decay_fraction)
