"""Fault injection for reliability tests: real failures at chosen steps, driven by environment variables.

``HYBRIDLM_FAULT_KILL_AT_STEP=k``      the process SIGKILLs itself right after optimizer step k
``HYBRIDLM_FAULT_TERM_AT_STEP=k``      the process SIGTERMs itself right after optimizer step k (a scheduler's
                                       pre-emption notice)
``HYBRIDLM_FAULT_NAN_AT_STEPS=a,b,c``  the loss of steps a, b, c (1-based) becomes NaN
``HYBRIDLM_FAULT_KILL_IN=save:k``      SIGKILL in the middle of the checkpoint save of step k (its files written,
                                       not yet committed); ``export``: in the middle of writing ``final/``
Unset (the normal case) they cost nothing.
"""
from __future__ import annotations

import os
import signal


def kill_if_requested(step: int) -> None:
    for variable, sig in (("HYBRIDLM_FAULT_KILL_AT_STEP", signal.SIGKILL), ("HYBRIDLM_FAULT_TERM_AT_STEP", signal.SIGTERM)):
        target = os.environ.get(variable)
        if target and int(target) == step:
            os.kill(os.getpid(), sig)


def nan_steps() -> set:
    raw = os.environ.get("HYBRIDLM_FAULT_NAN_AT_STEPS", "")
    return {int(s) for s in raw.split(",") if s.strip()}


def with_nan_faults(loss_fn, gradient_accumulation_steps: int):
    """Wrap ``loss_fn`` so the listed steps produce a NaN loss (micro-batch calls counted per step)."""
    steps = nan_steps()
    if not steps:
        return loss_fn
    calls = {"n": 0}

    def wrapped(model, batch):
        step = calls["n"] // gradient_accumulation_steps + 1
        calls["n"] += 1
        loss, metrics = loss_fn(model, batch)
        return (loss * float("nan") if step in steps else loss), metrics

    return wrapped


def kill_in(point: str, step: int = -1) -> None:
    """SIGKILL this process if ``HYBRIDLM_FAULT_KILL_IN`` names ``point`` (and, as ``point:k``, ``step``)."""
    target = os.environ.get("HYBRIDLM_FAULT_KILL_IN")
    if not target:
        return
    name, _, at = target.partition(":")
    if name == point and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)
