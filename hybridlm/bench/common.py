"""Pieces every benchmark needs: out-of-memory detection, freeing the GPU between entries, versions."""
from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from hybridlm.utils.atomic import write_json


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e).lower() or "CUBLAS_STATUS_ALLOC_FAILED" in str(e))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def versions() -> Dict[str, Optional[str]]:
    """The versions a GPU figure depends on (recorded in every benchmark report)."""
    from importlib import metadata
    out: Dict[str, Optional[str]] = {"torch": torch.__version__, "python": sys.version.split()[0],
                                     "cuda": torch.version.cuda}
    for key, dist in (("triton", "triton"), ("fla", "flash-linear-attention"), ("deepspeed", "deepspeed"),
                      ("transformers", "transformers")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def write_report(report: Dict, path: Path) -> None:
    """The report as JSON, replaced atomically (a reader or a cut-off call never sees half a file)."""
    write_json(path, report, default=str)


def merge_reports(paths: Sequence[str], entry_key: Callable[[Dict], Hashable],
                  derived: Sequence[str] = ()) -> Tuple[List[Dict], Dict]:
    """Join benchmark reports: the first report's header (less ``entries`` and the ``derived`` keys, which
    the caller recomputes) with ``merged_from``, and the entries of all, a later report's entry replacing
    an earlier one of the same ``entry_key``. Returns ``(reports, merged)``."""
    import json
    reports = [json.loads(Path(p).read_text()) for p in paths]
    skip = ("entries", *derived)
    merged = {k: v for k, v in reports[0].items() if k not in skip}
    merged["merged_from"] = [str(p) for p in paths]
    entries: Dict[Hashable, Dict] = {}
    for r in reports:
        for e in r["entries"]:
            entries[entry_key(e)] = e
    merged["entries"] = list(entries.values())
    return reports, merged
