"""One process per run directory: an exclusive ``flock`` on ``<output_dir>/.lock``, held for the whole run, and no run
inside the directory of another live run (a stage's folder inside a running route's).

The kernel releases the lock when the process ends, however it ends (SIGKILL included), so a killed run never
leaves a stale lock behind and the next run takes it at once. A second process on the same directory is
refused with one line naming the directory and the holder's pid (written into the lock file once held).

The lock file is opened without following links (``O_NOFOLLOW``) and must be a plain file with no other name
(one hard link): the pid is written only into the run folder's own file, never through a link to a file
elsewhere. A ``.lock`` that is a link, a directory or another kind of file, a folder or lock that cannot be
written (immutable, permissions) and a read-only filesystem each stop the run with one ``error:`` line (exit 4,
:mod:`hybridlm.training.exits`); nothing is written.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Optional, Set

LOCK_FILE = ".lock"
# O_NOFOLLOW: a link named .lock is refused (ELOOP), not followed; O_NONBLOCK: opening a FIFO does not wait
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK


class RunLockError(RuntimeError):
    """The run directory cannot be locked for this process (exit 4: the environment, not the input)."""


class RunDirectoryInUse(RunLockError):
    """Another live process holds the run directory's lock."""


class RunDirectoryUnusable(RunLockError):
    """The lock file cannot be made or used: a link, a directory, not writable, ..."""


class RunDirectoryReadOnly(RunDirectoryUnusable):
    """The run directory is on a read-only filesystem."""


def _holder(lock: Path) -> Optional[str]:
    """``"process <pid>"`` (or ``"another process"``) if a live process holds ``lock``, else None (a probe: the lock
    is taken and given back at once when free)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return f"process {pid}" if pid.isdigit() else "another process"
    finally:
        os.close(fd)
    return None


def _unusable(e: OSError, path: Path, what: str, run_dir: Path) -> RunLockError:
    """The one line for a lock file that cannot be opened, by its errno."""
    fix = f"or use another {what}"
    if e.errno == errno.EROFS:
        return RunDirectoryReadOnly(f"{what} {run_dir}: on a read-only filesystem, so it cannot be locked for a run "
                                    f"({path}); mount it writable {fix}")
    if e.errno == errno.ELOOP:
        return RunDirectoryUnusable(f"{what} {run_dir}: {path} is a symbolic link; the lock is never taken through a "
                                    f"link (it would write outside the run folder): remove the link {fix}")
    if e.errno == errno.EISDIR:
        return RunDirectoryUnusable(f"{what} {run_dir}: {path} is a directory, expected the run's lock file: remove "
                                    f"it {fix}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return RunDirectoryUnusable(f"{what} {run_dir}: {path} cannot be created or opened for writing "
                                    f"({e.strerror}: the folder or the lock is read-only or immutable, "
                                    f"e.g. chattr +i); make it writable {fix}")
    return RunDirectoryUnusable(f"{what} {run_dir}: its lock {path} cannot be opened ({e.strerror or e}) {fix}")


class RunLock:
    """``RunLock(output_dir).acquire()`` takes the lock or raises :class:`RunLockError`; ``release()`` (or the
    process's end) gives it back. A lock this process holds (the route's, around its stages) does not refuse a
    directory inside it."""

    _held_here: Set[Path] = set()  # the lock files this process holds (resolved)

    def __init__(self, output_dir, what: str = "run.output_dir") -> None:
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK_FILE
        self.what = what
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock; RunDirectoryInUse if another process holds it, or holds the lock of a directory above;
        RunDirectoryUnusable (RunDirectoryReadOnly) if the lock file cannot be made or is not a plain file."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except (NotADirectoryError, FileExistsError):
            raise  # the path is (inside) a file: a wrong input, said by the caller
        except OSError as e:
            raise _unusable(e, self.path, self.what, self.dir) from None
        for above in self.dir.resolve().parents:
            lock = above / LOCK_FILE
            if lock not in self._held_here:
                holder = _holder(lock)
                if holder is not None:
                    raise RunDirectoryInUse(f"{self.what} {self.dir}: inside {above}, in use by {holder} (it holds "
                                            f"{lock}); wait for it to finish or stop it, or use another {self.what}")
        try:
            fd = os.open(self.path, _OPEN_FLAGS, 0o644)
        except OSError as e:
            raise _unusable(e, self.path, self.what, self.dir) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                kind = "has other hard links" if stat.S_ISREG(st.st_mode) else "is not a regular file"
                raise RunDirectoryUnusable(f"{self.what} {self.dir}: {self.path} {kind}; the lock is written only into "
                                           f"the run folder's own file: remove it, or use another {self.what}")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise RunDirectoryInUse(f"{self.what} {self.dir}: in use by {who} (it holds {self.path}); wait for it to "
                                    f"finish or stop it, or use another {self.what}") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # the lock is held; only the pid (for the message of a second process) is missing
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                os.close(fd)
                raise _unusable(e, self.path, self.what, self.dir) from None
        self._fd = fd
        self._held_here.add(self.path.resolve())
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._held_here.discard(self.path.resolve())
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
