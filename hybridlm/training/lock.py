"""One process per run directory: an exclusive ``flock`` on ``<output_dir>/.lock``, held for the whole run, and no run
inside the directory of another live run (a stage's folder inside a running route's).

The kernel releases the lock when the process ends, however it ends (SIGKILL included), so a killed run never
leaves a stale lock behind and the next run takes it at once. A second process on the same directory is
refused with one line naming the directory and the holder's pid (written into the lock file once held).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Iterable, Optional

LOCK_FILE = ".lock"


class RunDirectoryInUse(RuntimeError):
    """Another live process holds the run directory's lock."""


def _holder(lock: Path) -> Optional[str]:
    """``"process <pid>"`` (or ``"another process"``) if a live process holds ``lock``, else None (a probe: the lock
    is taken and given back at once when free)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return f"process {pid}" if pid.isdigit() else "another process"
    finally:
        os.close(fd)
    return None


class RunLock:
    """``RunLock(output_dir).acquire()`` takes the lock or raises :class:`RunDirectoryInUse`; ``release()`` (or
    the process's end) gives it back."""

    def __init__(self, output_dir, what: str = "run.output_dir") -> None:
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK_FILE
        self.what = what
        self._fd: Optional[int] = None

    def acquire(self, held_here: Iterable[Path] = ()) -> "RunLock":
        """Take the lock; RunDirectoryInUse if another process holds it, or holds the lock of a directory above
        (except those in ``held_here``: this process's own)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        mine = {Path(p).resolve() for p in held_here}
        for above in self.dir.resolve().parents:
            lock = above / LOCK_FILE
            if lock.is_file() and lock not in mine:
                holder = _holder(lock)
                if holder is not None:
                    raise RunDirectoryInUse(f"{self.what} {self.dir}: inside {above}, in use by {holder} (it holds "
                                            f"{lock}); wait for it to finish or stop it, or use another {self.what}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise RunDirectoryInUse(f"{self.what} {self.dir}: in use by {who} (it holds {self.path}); wait for it to "
                                    f"finish or stop it, or use another {self.what}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
