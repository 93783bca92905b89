"""The asset cache: where fetched assets live and how one is built without ever looking complete half-way."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from hybridlm.data.packages import AssetError  # noqa: F401  (re-exported: every fetch raises it)


def cache_dir() -> Path:
    """Root of the asset cache: ``$HYBRIDLM_CACHE`` or ``~/.cache/hybridlm``."""
    return Path(os.environ.get("HYBRIDLM_CACHE") or Path.home() / ".cache" / "hybridlm").expanduser()


def atomic_build(final: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``final``; a no-op when ``final`` exists."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        out = tmp / "out"
        out.mkdir()
        build(out)
        try:
            os.rename(out, final)
        except OSError:
            if not final.is_dir():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
