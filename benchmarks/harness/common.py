"""Pieces every benchmark needs: out-of-memory detection, freeing the GPU between entries, versions, model YAMLs
by name, the default data."""
from __future__ import annotations

import gc
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from hybridlm.config.loader import load_config
from hybridlm.utils.atomic import write_json

REPO = Path(__file__).resolve().parents[2]
# the benchmarks' default data: Jane Austen with Llama-3.2's tokenizer, prepared on first use
DEFAULT_DATA = "data_cache/janeausten-llama3.2"
DEFAULT_SOURCES = ["asset:janeausten"]
DEFAULT_TOKENIZER = "asset:llama3.2"


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


def config_path(name: str) -> Path:
    """A model YAML by name (``configs/models/NAME.yaml``) or path."""
    p = Path(name).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return REPO / "configs" / "models" / f"{name}.yaml"


def model_section(name: str, overrides: Sequence[str]) -> Dict[str, Any]:
    """The ``model`` section of a model YAML (by name or path) with ``KEY=VALUE`` overrides."""
    return load_config(str(config_path(name)), [f"model.{o}" for o in overrides])["model"]
