"""Write a directory all-or-nothing: build it under a temporary name beside the target, then rename."""
from __future__ import annotations

import contextlib
import shutil
import uuid
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False):
    """``with atomic_directory(out) as tmp: write into tmp`` -> ``out`` appears complete or not at all."""
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
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
