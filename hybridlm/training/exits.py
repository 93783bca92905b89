"""How the training CLIs end: one line and an exit status per kind of stop, never a traceback for an expected one.

0 done; 2 bad configuration or input (``error:``); 3 stopped on repeated non-finite losses, checkpoint saved
(``error:``); 4 the environment failed, not the input (``error:``): the disk is full (the partial files
removed), or the run directory cannot be locked: in use by another process, its ``.lock`` a link, a directory or
not writable, or a read-only filesystem (:mod:`hybridlm.training.lock`); 143 stopped by a pre-emption signal at a
point where nothing is lost, rerun to go on (``stopped:``).

:func:`run_cli` owns the stop signals for the command (:data:`hybridlm.training.preempt.STOP`): a signal is
recorded, the command stops at its next safe point, and a command that finishes with a signal recorded, or fails
after one (a worker ended by the same signal, say), ends with the ``stopped:`` line, never an ``error:`` about its
input.
"""
from __future__ import annotations

import sys
from typing import Callable, Tuple, Type

from hybridlm.config.errors import ConfigError, last_line
from hybridlm.engine.engine import NonFiniteLossError
from hybridlm.training.lock import RunLockError
from hybridlm.training.preempt import EXIT_CODE as PREEMPTED_EXIT_CODE, STOP, Preempted
from hybridlm.utils.atomic import DiskFullError

ENVIRONMENT_EXIT_CODE = 4


def run_cli(fn: Callable[[], object], user_errors: Tuple[Type[BaseException], ...] = (ConfigError,)) -> int:
    """Run ``fn`` with the stop signals owned and turn the expected ways a run stops into (message on stderr, exit
    status). An entry point installs :data:`STOP` in its first line and keeps it to its exit (a signal while the
    interpreter shuts down is recorded, not fatal); otherwise it is installed here for ``fn`` only."""
    if STOP.installed:
        try:
            return _run(fn, user_errors)
        finally:
            STOP.answered()
    STOP.install()
    try:
        return _run(fn, user_errors)
    finally:
        STOP.uninstall()


def _run(fn: Callable[[], object], user_errors: Tuple[Type[BaseException], ...]) -> int:
    try:
        fn()
        STOP.check("as the command finished; its results are complete")
    except Preempted as e:  # a scheduler's signal, acted on at a safe point: the next run goes on from there
        return _stopped(str(e))
    except Exception as e:
        if STOP.requested:  # what failed after a stop was asked for is the stop's doing, not the input's
            return _stopped(f"stopped by {STOP.signal_name} before the command could finish ({last_line(e)}); "
                            f"rerun to go on from there")
        if isinstance(e, user_errors):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, NonFiniteLossError):  # the run stopped itself, its checkpoint saved
            print(f"error: {e}", file=sys.stderr)
            return 3
        if isinstance(e, (DiskFullError, RunLockError)):  # the machine, not the input: a stated status
            print(f"error: {e}", file=sys.stderr)
            return ENVIRONMENT_EXIT_CODE
        raise
    return 0


def _stopped(message: str) -> int:
    print(f"stopped: {message}", file=sys.stderr, flush=True)
    return PREEMPTED_EXIT_CODE
