"""All-or-nothing writes: a directory (built under a temporary name beside the target, then renamed), a text
file (temporary file, fsync, ``os.replace``), and the project's one JSON writer.

JSON goes out strict: a non-finite float (NaN, +-inf: a skipped step's loss, a perplexity that overflowed)
becomes ``null``, never the ``NaN`` / ``Infinity`` tokens that Python's ``json`` writes by default and other
readers reject. :func:`json_text` is that encoding as a string (for printed lines and JSONL rows),
:func:`write_json` writes it to a file atomically.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

TMP_PREFIX = ".tmp_"


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False):
    """``with atomic_directory(out) as tmp: write into tmp`` -> ``out`` appears complete or not at all."""
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
