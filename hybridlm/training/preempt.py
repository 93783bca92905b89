"""Pre-emption: SIGTERM or SIGUSR1 is a request to stop, recorded by one owner and acted on at safe points.

Schedulers (SLURM, Kubernetes, ``timeout``) send SIGTERM some seconds before they kill a job. :data:`STOP`, the
process's one :class:`StopRequest`, owns both signals from an entry point's first line (``install()``) to its exit.
Its handler only records the signal: it never raises into whatever runs (a library's ``except Exception`` would
rename the stop into an error about an input, a finalizer would swallow it). The program asks at points where
stopping loses nothing (:meth:`StopRequest.check`): between the loads of a run's start-up, after each training
step (the loop saves first), after a commit (an export, a result file), between the route's stages and at the
end of a command. Every stop ends in :class:`Preempted`, which the CLIs turn into one ``stopped:`` line and exit
143 (128 + SIGTERM); the next run resumes.

The entry scripts block both signals in their first statement, before their imports (seconds) run
(``pretrain.py``, ``upcycle``'s launcher ``upcycle/__main__.py``): a signal then waits for ``install()``, which
takes it over, rather than killing the process without a word.
A process forked from an owner (a data worker) starts with the default handlers, so its parent can end it.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import List, Optional

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 143


class Preempted(RuntimeError):
    """A run stopped on a pre-emption signal, at a point where nothing is lost."""


class StopRequest:
    """The stop signals of this process: ``install()`` takes them over, the handler records which one came,
    ``check(where)`` raises :class:`Preempted` at a safe point once one has, ``uninstall()`` gives them back."""

    def __init__(self) -> None:
        self.signal_name = ""          # the first stop signal received since install(); "" while none
        self._owner_pid: Optional[int] = None
        self._previous: List = []

    @property
    def requested(self) -> bool:
        return bool(self.signal_name)

    @property
    def installed(self) -> bool:
        return self._owner_pid == os.getpid()

    def install(self) -> "StopRequest":
        """Own SIGTERM and SIGUSR1 in this process (main thread; again: a no-op), and release any that arrived
        while an entry point held them blocked."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return self
        self.signal_name = ""
        self._previous = [signal.signal(s, self._record) for s in PREEMPT_SIGNALS]
        self._owner_pid = os.getpid()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPT_SIGNALS)  # a held signal is recorded here
        return self

    def uninstall(self) -> None:
        """Give the signals back to the handlers from before :meth:`install` (a CLI called in-process ends)."""
        if not self.installed:
            return
        for s, handler in zip(PREEMPT_SIGNALS, self._previous):
            signal.signal(s, handler)
        self._previous, self._owner_pid, self.signal_name = [], None, ""

    def _record(self, signum, _frame) -> None:
        # the whole handler: nothing here may raise into the code it interrupted
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def record(self, name: str) -> None:
        """Record a stop decided elsewhere (a signal another rank received)."""
        self.signal_name = self.signal_name or name

    def answered(self) -> None:
        """The request was acted on (the command reported it): a later command in this process starts clean."""
        self.signal_name = ""

    def check(self, where: str) -> None:
        """A safe point: raise :class:`Preempted` naming ``where`` if a stop was requested."""
        if self.signal_name:
            raise Preempted(f"stopped by {self.signal_name} {where}; rerun to go on from there")

    def _forget_in_forked_child(self) -> None:
        """A process forked from the owner (a tokenizer or data worker) gets the default handlers: its parent (a
        pool's ``terminate()``) ends it with SIGTERM, which an owner there would only record."""
        if self._owner_pid is not None and self._owner_pid != os.getpid():
            for s in PREEMPT_SIGNALS:
                signal.signal(s, signal.SIG_DFL)
            self._previous, self._owner_pid, self.signal_name = [], None, ""


STOP = StopRequest()
os.register_at_fork(after_in_child=STOP._forget_in_forked_child)
