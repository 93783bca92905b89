"""The shell every run executes in (pre-training, each distillation stage, the upcycling route): from its first
line to its exit it owns the run directory's lock, the pre-emption signals and the run's commit points.

- **One process per run directory.** Rank 0 takes ``<output_dir>/.lock`` (:class:`hybridlm.training.lock.RunLock`)
  for the whole run; a second run on the directory stops at once with one line naming the holder (exit 4). The
  route holds its directory's lock for all its stages; a stage it runs inside it shares that lock.
- **SIGTERM / SIGUSR1 at any instant.** While the run starts up, a signal stops it at once (nothing to save yet).
  While the training loop runs, the loop saves at the end of its step and stops (hybridlm/training/loop.py). While
  the run commits its results (:meth:`RunShell.committing`: the export, the result file), the signal is held
  until they are complete. Every case ends with one ``stopped:`` line and exit 143; rerunning resumes.
- **Exports** are built aside, marked complete and renamed into place (:func:`export_model`); a full disk is one
  line and exit 4 with the partial files removed.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator, List, Optional

from hybridlm.config.errors import ConfigError
from hybridlm.training.lock import RunLock
from hybridlm.training.preempt import PREEMPT_SIGNALS, Preempted
from hybridlm.utils.atomic import DiskFullError, atomic_directory, disk_full_error
from hybridlm.utils.faults import disk_full_in, kill_in, term_in

_SHELLS: List["RunShell"] = []  # the shells entered in this process, outermost first


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


class RunShell:
    """``with RunShell(output_dir, what="run.output_dir"):`` around a run's whole work. Nested shells (a stage inside
    the route) share the outer shell's signal handling; each takes its own directory's lock (rank 0), and none starts
    inside the directory of another live process's run."""

    def __init__(self, output_dir, what: str = "run.output_dir") -> None:
        self.dir = Path(output_dir).expanduser()
        self.what = what
        self.lock: Optional[RunLock] = None
        self.signal_name = ""
        self._holding = 0  # > 0 inside committing(): a signal waits
        self._previous: List = []

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> "RunShell":
        outer = _SHELLS[0] if _SHELLS else None
        if is_rank_zero():  # a stage inside the route takes its own folder's lock too: a stage run alone there waits
            try:
                self.lock = RunLock(self.dir, self.what).acquire(held_here=[s.lock.path for s in _SHELLS if s.lock])
            except (NotADirectoryError, FileExistsError) as e:
                raise ConfigError(f"{self.what}: {self.dir} cannot be a directory ({e.strerror}: {e.filename})") \
                    from None
        if outer is None and threading.current_thread() is threading.main_thread():
            self._previous = [signal.signal(s, self._on_signal) for s in PREEMPT_SIGNALS]
        _SHELLS.append(self)
        try:
            term_in("startup")
        except BaseException:
            self.__exit__(None, None, None)  # a stop on entry: the lock and the handlers go back
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        outermost = _SHELLS and _SHELLS[0] is self
        _SHELLS.remove(self)
        if self._previous:
            for s, handler in zip(PREEMPT_SIGNALS, self._previous):
                signal.signal(s, handler)
            self._previous = []
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if outermost and exc_type is None and self.signal_name:
            raise Preempted(f"stopped by {self.signal_name} as the run finished; its results are complete")

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if any(s._holding for s in _SHELLS):
            for s in _SHELLS:
                s.signal_name = s.signal_name or name
            return
        raise Preempted(f"stopped by {name} outside a training step (nothing unsaved); rerun to go on from there")

    @contextlib.contextmanager
    def committing(self, what: str) -> Iterator[None]:
        """Hold the pre-emption signals while ``what`` (the run's export, its result) is written; a signal received
        meanwhile stops the run once it is complete (exit 143)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        signalled = next((s.signal_name for s in _SHELLS if s.signal_name), "")
        if signalled and not any(s._holding for s in _SHELLS):
            raise Preempted(f"stopped by {signalled} after {what}, which is complete; rerun to go on from there")


def note_signal(name: str) -> None:
    """A pre-emption signal the training loop received after its last step: the shells stop the run (exit 143) once
    what follows is committed."""
    for s in _SHELLS:
        s.signal_name = s.signal_name or name


def export_model(final: Path, write: Callable[[Path], None], what: str = "the export") -> Path:
    """``write(tmp)`` the model into a folder built aside, marked complete and renamed to ``final`` (an earlier
    ``final`` is replaced whole: at every instant ``final`` is absent, the old export or the new one). A full disk
    raises :class:`DiskFullError` (one line, exit 4) after the partial folder is removed."""
    try:
        with atomic_directory(final, overwrite=True, marker=True,
                              before_commit=lambda stage: kill_in(f"export-{stage}")) as tmp:
            try:
                write(tmp)
                term_in("export")
                disk_full_in("export")
            except Exception as e:  # (told apart before the partial export is removed: it holds the space)
                full = disk_full_error(e, final, what)
                if full is None:
                    raise
                raise full from None
    except DiskFullError:
        raise
    except Exception as e:
        full = disk_full_error(e, final, what)
        if full is None:
            raise
        raise full from None
    kill_in("export-done")
    return final
