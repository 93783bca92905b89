"""Triton autotune results shipped with the package, keyed by GPU name and Triton version, served to the autotuners
before they time anything.

On a fresh GPU machine each Triton kernel (fla's and the project's) compiles and times every candidate
configuration the first time it meets a shape: minutes before the first training step (BENCHMARKS.md, "Cold
start"). This package ships the winners in ``hybridlm/ops/tuned/<gpu>.triton-<version>.json``, one file per GPU
name and Triton version, as vLLM ships per-device kernel configurations. When a model is built on a CUDA host
(``HybridForCausalLM.__init__``, before any of its kernels can launch), :func:`install_shipped_tuning` hooks Triton's
autotuner (``Autotuner.check_disk_cache``, the step that looks for an earlier result before timing the candidates;
the patch ``autotuner-shipped-results`` of hybridlm/patches.py); the first launch that reaches it loads the file that
matches its GPU and the installed Triton (:func:`apply_shipped_tuning`): a launch whose kernel, tuning key and
candidates match a shipped entry takes its winner and times nothing; any other launch tunes as usual.

An entry matches on the kernel's name and Triton's hash of its source (``JITFunction.cache_key``: the source, the
functions it calls, the constant globals it reads and the line the kernel starts at in its file), the tuning key
Triton computes (shapes, dtypes) and the candidate configurations; so an entry made for another kernel version,
shape or candidate list is never used, and a line added above a kernel voids its entries
(tests/test_tuning_coverage.py fails then). A
file made for another GPU or Triton, or whose content does not match its digest, is ignored with one line.

Files are made on the GPU they are for: runs with ``HYBRIDLM_RECORD_TUNING=FILE.jsonl`` append each tuned launch to
FILE, and ``python -m hybridlm.training.kernel_cache make`` turns that into a tuning file (see its ``--help``).
``HYBRIDLM_SHIPPED_TUNING=0`` turns the shipped results off.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from hybridlm import patches
from hybridlm.ops.triton_launch import interpreting
from hybridlm.utils.atomic import write_json
from hybridlm.utils.ranks import is_rank_zero

FORMAT = "hybridlm-kernel-tuning/1"
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"
ENTRY_FIELDS = ("kernel", "source", "key", "candidates", "config", "timing")


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels and autotune results: ``TRITON_CACHE_DIR`` or its default."""
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".triton" / "cache"


def gpu_slug(name: str) -> str:
    """A GPU name as a file name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shipped_file(gpu: str, triton_version: str, root: Optional[Path] = None) -> Path:
    return Path(root or SHIPPED_DIR) / f"{gpu_slug(gpu)}.triton-{triton_version}.json"


def shipped_files() -> List[Path]:
    return sorted(SHIPPED_DIR.glob("*.json"))


def entries_digest(entries: List[dict]) -> str:
    """sha256 of the entries in canonical JSON (sorted keys, no spaces): what a tuning file's ``sha256`` holds."""
    return hashlib.sha256(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def candidates_digest(configs: Iterable) -> str:
    """A short digest of an autotuner's candidate configurations (their ``str``, as Triton's own cache key uses)."""
    return hashlib.sha256("\n".join(str(c) for c in configs).encode()).hexdigest()[:16]


def entry_id(kernel: str, source: str, key: str, candidates: str) -> Tuple[str, str, str, str]:
    return kernel, source, key, candidates


def fla_version() -> Optional[str]:
    try:
        return metadata.version("flash-linear-attention")
    except metadata.PackageNotFoundError:
        return None


class TuningFileError(ValueError):
    """A tuning file whose content is not what it claims."""


def read_tuning_file(path: Path) -> dict:
    """A tuning file's content, checked: format, fields, every entry's fields and the digest; TuningFileError
    otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TuningFileError(f"{path}: not readable JSON ({type(e).__name__})")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TuningFileError(f"{path}: format is not {FORMAT!r}")
    for key in ("gpu", "triton", "entries", "sha256"):
        if key not in data:
            raise TuningFileError(f"{path}: no {key!r} field")
    entries = data["entries"]
    if not isinstance(entries, list):
        raise TuningFileError(f"{path}: 'entries' is not a list")
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and all(k in e for k in ENTRY_FIELDS) and isinstance(e["config"], dict)
                and isinstance(e["config"].get("kwargs"), dict)):
            raise TuningFileError(f"{path}: entry {i} lacks one of {', '.join(ENTRY_FIELDS)} or a config's kwargs")
    if entries_digest(entries) != data["sha256"]:
        raise TuningFileError(f"{path}: content does not match its sha256 (a damaged or edited file)")
    return data


@dataclass
class TuningStatus:
    """The shipped tuning this process serves: the file, its entries by id, one line, and the launches served from
    it (``hits``) and tuned afresh (``misses``) so far."""
    line: str
    file: Optional[Path] = None
    table: Optional[Dict[tuple, dict]] = None
    hits: int = 0
    misses: int = 0

    def served(self) -> str:
        """How the autotuned launches so far were served, for the first step's closing line."""
        if self.table is None:
            return ""
        return f"shipped tuning served {self.hits} autotuned kernels, {self.misses} tuned afresh"


def load_tuning(path: Path, gpu: str, triton_version: str) -> TuningStatus:
    """The tuning file ``path`` for ``gpu`` / ``triton_version``; never raises for its content: a mismatch or damage
    is the status's line, with no table."""
    path = Path(path)
    try:
        data = read_tuning_file(path)
    except TuningFileError as e:
        return TuningStatus(f"kernel tuning: ignored {e}; kernels autotune on first use", path)
    if data["gpu"] != gpu or data["triton"] != triton_version:
        return TuningStatus(f"kernel tuning: ignored {path.name}: made for {data['gpu']} / Triton {data['triton']}, "
                            f"this is {gpu} / Triton {triton_version}; kernels autotune on first use", path)
    table = {entry_id(e["kernel"], e["source"], e["key"], e["candidates"]): e for e in data["entries"]}
    return TuningStatus(f"kernel tuning: {len(table)} shipped autotune results for {gpu} / Triton {triton_version} "
                        f"({path.name}); a kernel, shape or candidate list not among them tunes on first use",
                        path, table)


_STATUS: Optional[TuningStatus] = None


def status() -> Optional[TuningStatus]:
    """This process's shipped tuning, once :func:`apply_shipped_tuning` ran on a CUDA device; else None."""
    return _STATUS


def install_shipped_tuning() -> None:
    """The explicit start, where a model is built: on a CUDA host, Triton's autotuner consults the shipped results
    (the patch ``autotuner-shipped-results``) before any kernel can launch. Nothing is read and no CUDA context is
    made here: the file for the GPU is chosen by the first launch that would time candidates, on its device."""
    if interpreting() or not torch.cuda.is_available():
        return
    _hook_autotuner()


def apply_shipped_tuning(device=None, quiet: bool = False) -> Optional[TuningStatus]:
    """Once per process, on a CUDA host (``device``: the GPU whose name picks the file; default: the current one):
    load the shipped file for its GPU and this Triton, hook the autotuner, and print the status line on stderr (rank 0
    only, unless ``quiet``); later calls return the same status and print nothing. Called by the hook at the first
    launch that would time candidates, and by the training loop's first-step notice (quiet: the notice says the
    line). None where there is nothing to do (no CUDA, Triton's interpreter)."""
    global _STATUS, _RECORDING
    if _STATUS is not None:
        return _STATUS
    if interpreting():
        return None
    if not torch.cuda.is_available():
        return None
    try:
        import triton
        gpu = torch.cuda.get_device_name(device)
    except Exception:  # no usable triton or driver: the Triton path reports that itself
        return None
    if os.environ.get("HYBRIDLM_SHIPPED_TUNING", "1") == "0":
        _STATUS = TuningStatus("kernel tuning: shipped results off (HYBRIDLM_SHIPPED_TUNING=0)")
    else:
        path = shipped_file(gpu, triton.__version__)
        if path.is_file():
            _STATUS = load_tuning(path, gpu, triton.__version__)
        else:
            have = ", ".join(p.stem for p in shipped_files()) or "none"
            _STATUS = TuningStatus(f"kernel tuning: none shipped for {gpu} / Triton {triton.__version__} (shipped: "
                                   f"{have}); kernels autotune on first use (`python -m "
                                   "hybridlm.training.kernel_cache --help` says how to make them)")
    _RECORDING = (gpu, triton.__version__, os.environ.get("HYBRIDLM_RECORD_TUNING"))
    _hook_autotuner()
    if not quiet and is_rank_zero():
        print(_STATUS.line, file=sys.stderr, flush=True)
    return _STATUS


# the GPU, Triton version and HYBRIDLM_RECORD_TUNING file the status was made for
_RECORDING: Tuple[str, str, Optional[str]] = ("", "", None)


def _jit_function(autotuner):
    from triton.runtime.jit import JITFunction
    fn = autotuner.fn
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def _hook_autotuner() -> None:
    """Triton's ``Autotuner.check_disk_cache`` wrapped by :func:`serving_check` (hybridlm/patches.py
    ``autotuner-shipped-results``: once a process)."""
    patches.apply("autotuner-shipped-results", serving_check)


def serving_check(original):
    """``original`` (Triton's ``check_disk_cache``) serving the winners of this process's shipped table first (made
    by :func:`apply_shipped_tuning` at the first launch that reaches it), and with ``HYBRIDLM_RECORD_TUNING`` set
    appending each launch it had to time to that JSONL file."""
    from triton import Config
    fla = fla_version()

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        if not tuning_key or any(c.pre_hook for c in configs):  # as Triton: such launches are always timed
            return original(self, tuning_key, configs, bench_fn)
        status = _STATUS if _STATUS is not None else apply_shipped_tuning(quiet=True)
        fn = _jit_function(self)
        ident = entry_id(fn.__name__, fn.cache_key, str(tuning_key), candidates_digest(configs))
        shipped = status.table.get(ident) if status is not None and status.table else None
        if shipped is not None:
            config = Config(**shipped["config"])
            self.cache[tuning_key] = config
            self.configs_timings = {config: shipped["timing"]}
            status.hits += 1
            return True
        if status is not None:
            status.misses += 1
        used = original(self, tuning_key, configs, bench_fn)
        gpu, triton_version, record = _RECORDING
        if record and tuning_key in self.cache:
            best = self.cache[tuning_key]
            timing = getattr(self, "configs_timings", {}).get(best)
            entry = dict(zip(ENTRY_FIELDS, (*ident, {k: v for k, v in best.__dict__.items() if k != "pre_hook"},
                                            timing)))
            line = json.dumps({"gpu": gpu, "triton": triton_version, "fla": fla, **entry}, default=str) + "\n"
            with open(record, "a") as f:  # one short write per line: lines of several ranks do not interleave
                f.write(line)
        return used

    return check_disk_cache


def read_records(records: List[Path]) -> Iterator[dict]:
    """The lines of ``HYBRIDLM_RECORD_TUNING`` files, in order; a line cut by a killed run is skipped."""
    for path in records:
        for line in Path(path).read_text().splitlines():
            try:
                yield json.loads(line)
            except ValueError:
                continue


def make_tuning_file(out: Path, records: List[Path], gpu: str, triton_version: str) -> dict:
    """A tuning file from the JSONL ``records`` of runs on ``gpu`` / ``triton_version`` (``HYBRIDLM_RECORD_TUNING``),
    merged with the file already at ``out`` if it is one for the same GPU and Triton (a later record of an entry
    wins). Lines for another GPU or Triton are left out. Written atomically; returns the content."""
    merged: Dict[tuple, dict] = {}
    if Path(out).is_file():
        try:
            old = read_tuning_file(out)
            if old["gpu"] == gpu and old["triton"] == triton_version:
                merged = {entry_id(e["kernel"], e["source"], e["key"], e["candidates"]): e for e in old["entries"]}
        except TuningFileError:
            pass
    for rec in read_records(records):
        if rec.get("gpu") != gpu or rec.get("triton") != triton_version:
            continue
        entry = {k: rec[k] for k in ENTRY_FIELDS}
        merged[entry_id(entry["kernel"], entry["source"], entry["key"], entry["candidates"])] = entry
    entries = [merged[k] for k in sorted(merged)]
    data = {"format": FORMAT, "gpu": gpu, "triton": triton_version, "fla": fla_version(), "entries": entries,
            "sha256": entries_digest(entries)}
    write_json(out, data, indent=None)
    return data
