"""Graceful pre-emption: SIGTERM or SIGUSR1 stops a run at the next step boundary with a checkpoint saved.

Schedulers (SLURM, Kubernetes, ``timeout``) send SIGTERM some seconds before they kill a job. Without a
handler the process dies mid-step and the run loses every step since its last periodic checkpoint. With
it, the training loop finishes the step it is in, saves, and raises :class:`Preempted`; the CLIs turn that
into one line and exit code 143 (128 + SIGTERM), and the next run resumes from that checkpoint.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, List

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 143


class Preempted(RuntimeError):
    """A run stopped on a pre-emption signal, its checkpoint saved."""


class PreemptionFlag:
    """The signal handler: records the signal; the training loop checks it after every step."""

    def __init__(self) -> None:
        self.signal_name = ""

    def __call__(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name


@contextmanager
def preemption_flag() -> Iterator[PreemptionFlag]:
    """Catch the pre-emption signals for the duration of a training loop (main thread only)."""
    flag = PreemptionFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous: List = [signal.signal(s, flag) for s in PREEMPT_SIGNALS]
    try:
        yield flag
    finally:
        for s, handler in zip(PREEMPT_SIGNALS, previous):
            signal.signal(s, handler)
