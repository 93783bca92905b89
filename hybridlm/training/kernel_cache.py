"""Carry Triton autotune results (fla's kernels' and the project's own) from one machine to the next.

On a fresh GPU machine the first training step autotunes every fla kernel for the run's shapes: Triton
compiles and times each candidate configuration (146.6 s for GDN-300M at micro-batch 64 on an H200). Triton
keeps the winners as small ``<hash>/<kernel>.autotune.json`` files in its cache directory
(:func:`hybridlm.training.cold_start.triton_cache_dir`); the hash covers the kernel source, the Triton version
and the GPU, so a file only ever applies where it was made. Handed those files, a fresh machine compiles just
the winning configuration of each kernel (17.2 s for the same first step; BENCHMARKS.md, "Cold start"). The
project's own kernels (hybridlm/ops/) keep theirs the same way (``autotuned`` in hybridlm/ops/triton_launch.py).

    python -m hybridlm.training.kernel_cache export tuned.tar.xz   # after a run, on the tuned machine
    python -m hybridlm.training.kernel_cache import tuned.tar.xz   # on the next machine, before training

Only JSON files with those names are read from an archive: anything else (links, folders climbing out of the
cache, other files, invalid JSON) is refused with one ``error:`` line and nothing is written.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tarfile
from pathlib import Path
from typing import Dict, List, Optional

from hybridlm.training.cold_start import triton_cache_dir
from hybridlm.utils.atomic import atomic_write_bytes

SUFFIX = ".autotune.json"
# Triton's cache folder names are base32 hashes; a member is exactly <folder>/<kernel name>.autotune.json
MEMBER = re.compile(r"^[A-Za-z0-9_-]+/[A-Za-z0-9_.-]+\.autotune\.json$")


class KernelCacheError(ValueError):
    """An archive that is not a set of autotune results."""


def autotune_files(cache: Optional[Path] = None) -> List[Path]:
    """The autotune result files under ``cache`` (default: Triton's cache directory), sorted."""
    root = Path(cache) if cache else triton_cache_dir()
    return sorted(p for p in root.glob(f"*/*{SUFFIX}") if p.is_file()) if root.is_dir() else []


def export_autotune(archive: Path, cache: Optional[Path] = None) -> int:
    """Write every autotune result of ``cache`` into the ``.tar.xz`` ``archive`` (atomically); the count."""
    root = Path(cache) if cache else triton_cache_dir()
    files = autotune_files(root)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for path in files:
            tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)
    atomic_write_bytes(archive, buf.getvalue())
    return len(files)


def read_archive(archive: Path) -> Dict[str, bytes]:
    """``{member name: bytes}`` of an export, every member checked; KernelCacheError naming the first bad one."""
    archive = Path(archive)
    if not archive.is_file():
        raise KernelCacheError(f"{archive}: no such file (expected a .tar.xz from `kernel_cache export`)")
    out: Dict[str, bytes] = {}
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for m in tar.getmembers():
                if m.name == "." and m.isdir():  # `tar -C cache .` lists its root first
                    continue
                name = m.name[2:] if m.name.startswith("./") else m.name
                if not m.isfile() or not MEMBER.match(name):
                    raise KernelCacheError(f"{archive}: member {m.name!r} is not <folder>/<kernel>{SUFFIX}; "
                                           "refusing the archive")
                data = tar.extractfile(m).read()
                try:
                    json.loads(data)
                except ValueError:
                    raise KernelCacheError(f"{archive}: member {m.name!r} is not valid JSON; refusing the archive")
                out[name] = data
    except (tarfile.TarError, EOFError, OSError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KernelCacheError(f"{archive}: not a readable tar archive ({why})")
    return out


def import_autotune(archive: Path, cache: Optional[Path] = None) -> int:
    """Put the autotune results of ``archive`` into ``cache`` (default: Triton's); the count. Existing files
    with the same name are replaced: a result only depends on its key, so they hold the same choice."""
    root = Path(cache) if cache else triton_cache_dir()
    members = read_archive(archive)  # every member checked before the first is written
    for name, data in members.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    return len(members)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridlm.training.kernel_cache",
                                 description="Export / import fla's Triton autotune results (minutes of a fresh "
                                             "machine's first step).")
    ap.add_argument("action", choices=("export", "import", "list"))
    ap.add_argument("archive", nargs="?", help="the .tar.xz (export / import)")
    ap.add_argument("--cache", default=None, help="Triton cache directory (default: $TRITON_CACHE_DIR or "
                                                  "~/.triton/cache)")
    args = ap.parse_args(argv)
    cache = Path(args.cache) if args.cache else triton_cache_dir()
    if args.action == "list":
        for path in autotune_files(cache):
            print(path.relative_to(cache).as_posix())
        return 0
    if not args.archive:
        ap.error(f"{args.action} needs an archive path")
    try:
        if args.action == "export":
            n = export_autotune(Path(args.archive), cache)
            print(f"exported {n} autotune results from {cache} to {args.archive}")
        else:
            n = import_autotune(Path(args.archive), cache)
            print(f"imported {n} autotune results into {cache}")
    except KernelCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
