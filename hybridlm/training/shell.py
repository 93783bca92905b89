"""The shell every run executes in (pre-training, each distillation stage, the upcycling route): from its first
line to its exit it owns the run directory's lock and the run's commit points; the stop signals are owned by the
process's one :data:`hybridlm.training.preempt.STOP`, which the shell and the training loop both ask.

- **One process per run directory.** Rank 0 (:func:`hybridlm.utils.ranks.is_rank_zero`, asked before the process
  group exists) takes ``<output_dir>/.lock`` (:class:`hybridlm.training.lock.RunLock`) for the whole run; a second
  run on the directory stops at once with one line naming the holder (exit 4). The route holds its directory's
  lock for all its stages; a stage it runs inside it takes its own folder's lock too.
- **SIGTERM / SIGUSR1 at any instant.** The signal is recorded, never raised into what runs. While the run starts
  up it stops at the next safe point (:meth:`RunShell.check`: between loads); while the training loop runs, the
  loop saves at the end of its step and stops (hybridlm/training/loop.py); while the run commits its results
  (:meth:`RunShell.committing`: the export, the result file) it stops once they are complete. Every case ends
  with one ``stopped:`` line and exit 143; rerunning resumes.
- **Exports** are built aside, marked complete with the list of their files and renamed into place
  (:func:`export_model`); a full disk is one line and exit 4 with the partial files removed.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from hybridlm.config.errors import ConfigError
from hybridlm.training.lock import RunLock
from hybridlm.training.preempt import STOP, Preempted
from hybridlm.utils.atomic import DiskFullError, atomic_directory, disk_full_error
from hybridlm.utils.faults import disk_full_in, kill_in, term_in
from hybridlm.utils.ranks import is_rank_zero


class RunShell:
    """``with RunShell(output_dir, what="run.output_dir"):`` around a run's whole work. Rank 0 takes the directory's
    lock (a stage inside the route takes its own folder's too); none starts inside the directory of another live
    process's run. The stop signals belong to :data:`STOP`: the shell installs it when no entry point did (a run
    called from Python), and asks it at its safe points."""

    def __init__(self, output_dir, what: str = "run.output_dir") -> None:
        self.dir = Path(output_dir).expanduser()
        self.what = what
        self.lock: Optional[RunLock] = None
        self._installed_here = False

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> "RunShell":
        if not STOP.installed:  # a run started from Python, not through a CLI: the shell owns the signals meanwhile
            STOP.install()
            self._installed_here = STOP.installed
        try:
            if is_rank_zero():
                try:
                    self.lock = RunLock(self.dir, self.what).acquire()
                except (NotADirectoryError, FileExistsError) as e:
                    raise ConfigError(f"{self.what}: {self.dir} cannot be a directory ({e.strerror}: {e.filename})") \
                        from None
            term_in("startup")
            self.check("as the run started (nothing to save yet)")
        except BaseException:
            self._leave()  # a stop on entry: the lock and the handlers go back
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pending = STOP.signal_name
        self._leave()
        if exc_type is None and pending:
            raise Preempted(f"stopped by {pending} as the run finished; its results are complete")

    def _leave(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self._installed_here:
            self._installed_here = False
            STOP.uninstall()

    # ------------------------------------------------------------------ signals
    @staticmethod
    def check(where: str) -> None:
        """A safe point of the run's start-up: stop (:class:`Preempted`) if a signal asked for it."""
        STOP.check(where)

    @contextlib.contextmanager
    def committing(self, what: str) -> Iterator[None]:
        """``what`` (the run's export, its result) is written whole whatever signal comes meanwhile; a signal
        received before or during it stops the run once it is complete (exit 143)."""
        yield
        STOP.check(f"after {what}, which is complete")


def export_model(final: Path, write: Callable[[Path], None], what: str = "the export",
                 amendable: Iterable[str] = ()) -> Path:
    """``write(tmp)`` the model into a folder built aside, marked complete and renamed to ``final`` (an earlier
    ``final`` is replaced whole: at every instant ``final`` is absent, the old export or the new one). A full disk
    raises :class:`DiskFullError` (one line, exit 4) after the partial folder is removed."""
    try:
        with atomic_directory(final, overwrite=True, marker=True, amendable=amendable,
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
