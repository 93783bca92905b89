"""All-or-nothing writes: a directory (built under a temporary name beside the target, then renamed), a text
file (temporary file, fsync, ``os.replace``), and the project's one JSON writer.

JSON goes out strict: a non-finite float (NaN, +-inf: a skipped step's loss, a perplexity that overflowed)
becomes ``null``, never the ``NaN`` / ``Infinity`` tokens that Python's ``json`` writes by default and other
readers reject. :func:`json_text` is that encoding as a string (for printed lines and JSONL rows),
:func:`write_json` writes it to a file atomically.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

TMP_PREFIX = ".tmp_"


class DiskFullError(RuntimeError):
    """A write failed for want of space (ENOSPC / EDQUOT); its partial files are removed (one line naming the
    path)."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a write that failed for want of space, by its
    errno or message."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(exc: BaseException, path, what: str) -> Optional[DiskFullError]:
    """A :class:`DiskFullError` naming ``path`` when ``exc`` is a full disk: :func:`is_disk_full`, or any failure
    of a write while the filesystem where ``path`` lives has under 1 MiB free (torch's writer reports ENOSPC as
    "basic_ios::clear: iostream error" or "unexpected pos"); else None. Call it before removing partial files."""
    full = is_disk_full(exc)
    if not full:
        probe = Path(path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            full = shutil.disk_usage(probe).free < (1 << 20)
        except OSError:
            full = False
    if not full:
        return None
    return DiskFullError(f"{path}: the disk is full ({what} failed: no space left on device); its partial files "
                         f"were removed, free some space and rerun")


COMPLETE_MARKER = ".complete"  # written last into an atomic directory: its presence means every file is there


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False, *, marker: bool = False, amendable: Iterable[str] = (),
                     before_commit: Optional[Callable[[str], None]] = None):
    """``with atomic_directory(out) as tmp: write into tmp`` -> ``out`` appears complete or not at all.

    The new content is built in ``.<name>.tmp-<id>`` beside ``out``, gets :data:`COMPLETE_MARKER` as its last
    file when ``marker`` is set (listing every file and its size, :func:`verify_complete_directory`; a file named
    in ``amendable``, which its writer may later replace atomically, listed by name only), is fsynced and renamed
    into place. An existing ``out`` (``overwrite``) is first
    renamed aside to ``.<name>.old-<id>`` and deleted only once the new one is in place, so at every instant
    ``out`` is either absent, the old complete directory or the new complete one. ``before_commit(stage)``, if given, is called
    with ``"written"`` (the new content complete, nothing renamed), ``"aside"`` (the old one renamed aside,
    the new one not yet in place) and ``"placed"`` (the new one in place, the old one not yet deleted).
    Leftovers of a process killed part-way are cleared by the next call: ``.<name>.tmp-*`` removed, and a
    ``.<name>.old-*`` renamed back to ``out`` when ``out`` is absent (a kill between the two renames), else
    removed.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    for stale in sorted(final.parent.glob(f".{final.name}.old-*")):
        if not final.exists():  # killed with the old one aside and the new one not yet in place
            os.rename(stale, final)
        else:
            shutil.rmtree(stale, ignore_errors=True)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: already exists")
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    hook = before_commit or (lambda stage: None)
    old = None
    try:
        yield tmp
        if marker:
            (tmp / COMPLETE_MARKER).write_text(_listing(tmp, set(amendable)))
        fsync_tree(str(tmp))
        hook("written")
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            hook("aside")
        os.rename(tmp, final)
        fsync_dir(str(final.parent))
        hook("placed")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if old is not None and not final.exists():  # failed between the two renames: the old one goes back
            os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _listing(root: Path, amendable: set) -> str:
    """The marker's text: ``complete``, then ``<size> <path>`` per file below ``root`` (``- <path>`` for an
    amendable one), sorted."""
    lines = ["complete"]
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER):
        rel = path.relative_to(root).as_posix()
        lines.append(f"- {rel}" if rel in amendable else f"{path.stat().st_size} {rel}")
    return "\n".join(lines) + "\n"


def verify_complete_directory(path) -> Optional[str]:
    """None when ``path`` is a directory :func:`atomic_directory` finished and every file its marker lists is there
    at the listed size (a marker from before listings were written, ``complete`` alone, lists none); else why not,
    as a phrase for a one-line message."""
    root = Path(path)
    marker = root / COMPLETE_MARKER
    if not root.is_dir():
        return f"{root} does not exist" if not root.exists() else f"{root} is not a directory"
    if not marker.is_file():
        return f"{marker} is missing (the export never completed, or it was removed)"
    try:
        lines = marker.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        return f"{marker} cannot be read ({e})"
    if not lines or lines[0] != "complete":
        return f"{marker} is not a completion marker"
    for line in lines[1:]:
        size, _, rel = line.partition(" ")
        file = root / rel
        if not rel or (size != "-" and not size.isdigit()):
            return f"{marker}: line {line!r} is not '<size> <path>'"
        if not file.is_file():
            return f"{file}, listed in {marker}, is missing"
        if size != "-" and file.stat().st_size != int(size):
            return f"{file} holds {file.stat().st_size} bytes, {marker} lists {size}"
    return None


def is_complete_directory(path) -> bool:
    """Whether ``path`` is a directory that :func:`atomic_directory` finished, every listed file as listed."""
    return verify_complete_directory(path) is None


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file below ``root`` and then every directory, deepest first (checkpoints and exports)."""
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(root):
        dirs.append(dirpath)
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
    for d in reversed(dirs):
        fsync_dir(d)


def fsync_dir(path: str) -> None:
    """Persist a directory's entries (renames, creations).  Not every platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` so that readers see either the old or the new content."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old or the new content."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def save_figure(fig, path, dpi: int = 120) -> Path:
    """Write a matplotlib figure as a PNG atomically (rendered in memory, then :func:`atomic_write_bytes`) and
    close it: a report's picture is the old one or the new one, never half a file."""

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    if getattr(fig.canvas, "manager", None) is not None:  # made by pyplot, which keeps it until closed
        import matplotlib.pyplot as plt
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth of dicts, lists and tuples) replaced by ``None``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def json_text(obj: Any, *, indent: Optional[int] = None, default: Optional[Callable[[Any], Any]] = None,
              **kwargs) -> str:
    """Strict JSON of ``obj``: non-finite floats written as ``null`` (``json.dumps(..., allow_nan=False)``
    of :func:`finite_or_none`). ``default`` converts other objects, as in ``json.dumps``; what it returns is
    made finite too."""
    hook = None if default is None else (lambda o: finite_or_none(default(o)))
    return json.dumps(finite_or_none(obj), indent=indent, default=hook, allow_nan=False, **kwargs)


def write_json(path, obj: Any, *, indent: Optional[int] = 2, default: Optional[Callable[[Any], Any]] = None,
               **kwargs) -> None:
    """``obj`` as strict JSON (:func:`json_text`, a final newline) in ``path``, written atomically (parent
    directories made as needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json_text(obj, indent=indent, default=default, **kwargs) + "\n")
