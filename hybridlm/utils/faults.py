"""Fault injection for reliability tests: real failures at chosen steps, driven by environment variables.

``HYBRIDLM_FAULT_KILL_AT_STEP=k``      the process SIGKILLs itself right after optimizer step k
``HYBRIDLM_FAULT_TERM_AT_STEP=k``      the process SIGTERMs itself right after optimizer step k (a scheduler's
                                       pre-emption notice)
``HYBRIDLM_FAULT_STOP_AT_STEP=k``      the process SIGSTOPs itself right after optimizer step k (it holds its
                                       run directory, frozen, until it gets SIGCONT)
``HYBRIDLM_FAULT_NAN_AT_STEPS=a,b,c``  the loss of steps a, b, c (1-based) becomes NaN
``HYBRIDLM_FAULT_KILL_IN=point[:k]``   SIGKILL at a named instant (of the checkpoint save of step k):
                                       ``save``            the checkpoint's files written, nothing committed
                                       ``save-committed``  renamed into place, ``latest`` not yet naming it
                                       ``save-latest``     ``latest`` names it, the older ones not yet deleted
                                       ``export``          in ``final/``'s temporary folder, the weights
                                                           written, the tokenizer not
                                       ``export-written``  the new export complete, nothing renamed
                                       ``export-aside``    the old ``final/`` renamed aside, the new one not
                                                           yet in place
                                       ``export-placed``   the new ``final/`` in place, the old not deleted
                                       ``export-done``     ``final/`` complete, ``result.json`` not written
                                       ``prepare``         in a tokenizer worker of ``prepare``: the preparing
                                                           process is killed
                                       a point without ``:k`` matches every step
``HYBRIDLM_FAULT_TERM_IN=point``         SIGTERM (a scheduler's notice) at a named instant of the run shell:
                                       ``startup``  the run checked, its data and model not yet built
                                       ``load``     inside a distillation stage's student load, whose
                                                    ``except`` turns a failure into an error about the input
                                       ``export``   inside the export, as ``HYBRIDLM_FAULT_KILL_IN=export``
``HYBRIDLM_FAULT_DISK_FULL_IN=point[:k]``  at that instant (``save``, ``save-latest``, ``export``) a write fails with ENOSPC,
                                       as on a full disk
Unset (the normal case) they cost nothing.
"""
from __future__ import annotations

import errno
import os
import signal
from typing import Optional


def kill_if_requested(step: int) -> None:
    for variable, sig in (("HYBRIDLM_FAULT_KILL_AT_STEP", signal.SIGKILL),
                          ("HYBRIDLM_FAULT_TERM_AT_STEP", signal.SIGTERM),
                          ("HYBRIDLM_FAULT_STOP_AT_STEP", signal.SIGSTOP)):
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


def _matches(variable: str, point: str, step: int) -> bool:
    target = os.environ.get(variable)
    if not target:
        return False
    name, _, at = target.partition(":")
    return name == point and (not at or int(at) == step)


def kill_in(point: str, step: int = -1, pid: Optional[int] = None) -> None:
    """SIGKILL this process (or ``pid``) if ``HYBRIDLM_FAULT_KILL_IN`` names ``point`` (and, as ``point:k``,
    ``step``)."""
    if _matches("HYBRIDLM_FAULT_KILL_IN", point, step):
        os.kill(pid if pid is not None else os.getpid(), signal.SIGKILL)


def term_in(point: str) -> None:
    """SIGTERM this process if ``HYBRIDLM_FAULT_TERM_IN`` names ``point``."""
    if _matches("HYBRIDLM_FAULT_TERM_IN", point, -1):
        os.kill(os.getpid(), signal.SIGTERM)


def disk_full_in(point: str, step: int = -1) -> None:
    """Raise ``OSError(ENOSPC)`` if ``HYBRIDLM_FAULT_DISK_FULL_IN`` names ``point`` (and ``step``)."""
    if _matches("HYBRIDLM_FAULT_DISK_FULL_IN", point, step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
