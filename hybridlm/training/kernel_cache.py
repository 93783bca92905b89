"""Triton autotune results: the ones shipped with the package, and carrying a machine's own to the next machine.

On a fresh GPU machine each Triton kernel (fla's and the project's) compiles and times every candidate configuration
the first time it meets a shape: minutes before the first step (BENCHMARKS.md, "Cold start"). Triton keeps each
winner as ``<hash>/<kernel>.autotune.json`` in its cache directory
(:func:`hybridlm.ops.tuning.triton_cache_dir`); the hash covers the kernel source, the Triton version and the GPU
architecture, so a result only ever applies where it was made. Handed those results, a fresh machine compiles just
the winning configuration of each kernel.

The package ships the results for the GPUs in ``hybridlm/ops/tuned/`` (one file per GPU name and Triton version) and
serves the matching file to Triton's autotuner by itself (:mod:`hybridlm.ops.tuning`). For another GPU, or another
Triton, make the file on that GPU once: record the launches that had to be tuned while running the shapes you use,
then turn the record into a tuning file (merged with the one already there for this GPU, if any):

    export HYBRIDLM_RECORD_TUNING=$PWD/tuning.jsonl
    bash benchmarks/acceptance.sh OUT_DIR                   # or any runs at the shapes you use
    python -m hybridlm.training.kernel_cache make \
        hybridlm/ops/tuned/$(python -m hybridlm.training.kernel_cache name) --records tuning.jsonl

Records name their GPU and Triton, so ``make`` also runs on a machine without a GPU, from records brought back from
one GPU. ``tests/test_tuning_coverage.py`` works out on a CPU which autotuned launches the acceptance run, the route and
each shipped pre-training config make, and fails where a shipped file lacks one it is meant to hold. ``shipped`` lists the shipped files and says which one applies here and why. A machine's own results also travel as
an archive:

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

import torch

from hybridlm.ops import tuning
from hybridlm.ops.tuning import triton_cache_dir
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


def _this_gpu():
    """(GPU name, Triton version) of this machine; KernelCacheError without CUDA or triton."""
    if not torch.cuda.is_available():
        raise KernelCacheError("no CUDA GPU here: tuning files are made and matched on the GPU they are for")
    import triton
    return torch.cuda.get_device_name(), triton.__version__


def _records_gpu(records: List[str]):
    """(GPU name, Triton version) that every line of the records names: a file can be made from records brought
    back from the GPU they were taken on, on a machine without one."""
    seen = {(rec.get("gpu"), rec.get("triton")) for rec in tuning.read_records([Path(r) for r in records])}
    if len(seen) != 1 or None in next(iter(seen), (None,)):
        found = ", ".join(f"{g} / Triton {t}" for g, t in sorted(seen, key=str)) or "none"
        raise KernelCacheError(f"no CUDA GPU here and the records do not name one GPU and Triton version ({found}); "
                               f"make the file on the GPU, or from the records of one GPU")
    return next(iter(seen))


def _shipped_report() -> List[str]:
    lines = []
    for path in tuning.shipped_files():
        try:
            data = tuning.read_tuning_file(path)
            lines.append(f"{path.name}: {data['gpu']} / Triton {data['triton']} / fla {data.get('fla')}: "
                         f"{len(data['entries'])} results")
        except tuning.TuningFileError as e:
            lines.append(f"{path.name}: refused: {e}")
    return lines or [f"none in {tuning.SHIPPED_DIR}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridlm.training.kernel_cache",
                                 description="Triton autotune results: make a tuning file for this GPU (make, "
                                             "name), list the shipped ones (shipped), or carry a machine's results "
                                             "to another (export / import / list).",
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("make", "name", "shipped", "export", "import", "list"))
    ap.add_argument("path", nargs="?", help="make: the tuning file (.json) to write; export / import: the .tar.xz")
    ap.add_argument("--records", nargs="+", default=[], metavar="JSONL",
                    help="make: the files runs with HYBRIDLM_RECORD_TUNING wrote")
    ap.add_argument("--cache", default=None, help="Triton cache directory (default: $TRITON_CACHE_DIR or "
                                                  "~/.triton/cache)")
    args = ap.parse_args(argv)
    cache = Path(args.cache) if args.cache else triton_cache_dir()
    if args.action == "list":
        for path in autotune_files(cache):
            print(path.relative_to(cache).as_posix())
        return 0
    if args.action == "shipped":
        print("\n".join(_shipped_report()))
        try:
            gpu, version = _this_gpu()
        except (KernelCacheError, ImportError) as e:
            print(f"here: {e}")
            return 0
        path = tuning.shipped_file(gpu, version)
        print(f"here: {gpu} / Triton {version}: " + (path.name if path.is_file() else "no shipped file"))
        return 0
    try:
        if args.action == "name":
            print(tuning.shipped_file(*_this_gpu()).name)
            return 0
        if args.action == "make":
            if not args.path:
                ap.error("make needs the path of the tuning file to write")
            missing = [r for r in args.records if not Path(r).is_file()]
            if not args.records or missing:
                raise KernelCacheError(f"make needs --records: the JSONL files of runs with HYBRIDLM_RECORD_TUNING "
                                       f"({'not found: ' + ', '.join(missing) if missing else 'none given'})")
            gpu, version = _this_gpu() if torch.cuda.is_available() else _records_gpu(args.records)
            data = tuning.make_tuning_file(Path(args.path), [Path(r) for r in args.records], gpu, version)
            print(f"made {args.path}: {len(data['entries'])} autotune results for {gpu} / Triton {version} "
                  f"(shipped as hybridlm/ops/tuned/{tuning.shipped_file(gpu, version).name})")
            return 0
        if not args.path:
            ap.error(f"{args.action} needs an archive path")
        if args.action == "export":
            n = export_autotune(Path(args.path), cache)
            print(f"exported {n} autotune results from {cache} to {args.path}")
        else:
            n = import_autotune(Path(args.path), cache)
            print(f"imported {n} autotune results into {cache}")
    except KernelCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
