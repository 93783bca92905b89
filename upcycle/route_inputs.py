"""Every input the route reads, checked before its first stage: the teacher, each stage's data sources or files,
the calibration and held-out sources. A missing one is one ConfigError naming the key, found in a second instead
of after init and ILD have run. Nothing is fetched here: an ``asset:`` name only has to be known."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from hybridlm.config.errors import ConfigError
from hybridlm.data.assets import ASSET_PREFIX, asset_names
from hybridlm.data.config import source_entries
from hybridlm.data.prepare import META
from hybridlm.teacher import TEACHER_ASSETS


def check_teacher(spec: str, where: str = "teacher") -> None:
    if spec.startswith(ASSET_PREFIX):
        if spec[len(ASSET_PREFIX):] not in TEACHER_ASSETS:
            known = ", ".join(ASSET_PREFIX + n for n in TEACHER_ASSETS)
            raise ConfigError(f"{where}: {spec!r} is not a known teacher asset (known: {known})")
        return
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return
    if not (p / "config.json").is_file():
        raise ConfigError(f"{where}: {spec!r} is not a transformers model directory (no config.json) or a .gguf "
                          f"file" + ("" if p.exists() else "; it does not exist"))


def check_source(spec: str, where: str) -> None:
    """An ``asset:`` name that exists, a ``hf:`` dataset name (checked when loaded), or an existing path."""
    if spec.startswith(ASSET_PREFIX):
        if spec[len(ASSET_PREFIX):] not in asset_names():
            known = ", ".join(ASSET_PREFIX + n for n in asset_names())
            raise ConfigError(f"{where}: unknown asset {spec!r} (known: {known})")
    elif not spec.startswith("hf:") and not Path(spec).expanduser().exists():
        raise ConfigError(f"{where}: {spec!r} does not exist")


def check_packed(data, where: str, prepared_by: Iterable[str] = ()) -> None:
    """A packed data section: already prepared, prepared by an earlier stage, or sources that exist."""
    path = Path(data.path).expanduser()
    if (path / META).is_file() or str(path) in {str(Path(p).expanduser()) for p in prepared_by}:
        return
    if not data.sources:
        raise ConfigError(f"{where}.path: {path / META} does not exist and {where}.sources is empty")
    for i, (spec, _) in enumerate(source_entries(data.sources, f"{where}.sources")):
        check_source(spec, f"{where}.sources[{i}]")


def check_record_file(spec: str, where: str) -> None:
    check_source(spec, where)
    if not spec.startswith(ASSET_PREFIX) and not Path(spec).expanduser().is_file():
        raise ConfigError(f"{where}: {spec!r} is not a file (expected a .json / .jsonl file or an asset: name)")


def check_route_inputs(teacher: str, built: Dict[str, Dict[str, Any]], calib_sources: Iterable[str],
                       heldout_sources: Optional[Iterable[str]] = ()) -> None:
    """``built``: the route's checked stage sections (``ild``, ``kd``, [``long_context``], ``dpo``)."""
    check_teacher(teacher)
    ild = built["ild"]["data"]
    check_packed(ild, "ild.data")
    for i, spec in enumerate(calib_sources or ()):
        if str(Path(spec).expanduser()) != str(Path(ild.path).expanduser()):  # the ILD data is prepared first
            check_source(spec, f"init.calib_sources[{i}]")
    kd = built["kd"]["data"]
    if hasattr(kd, "sources"):
        check_packed(kd, "kd.data", prepared_by=[ild.path])
    else:
        check_record_file(kd.path, "kd.data.path")
    if "long_context" in built:
        check_packed(built["long_context"]["data"], "long_context.data", prepared_by=[ild.path, kd.path])
    check_record_file(built["dpo"]["data"].path, "dpo.data.path")
    for i, spec in enumerate(heldout_sources or ()):
        check_source(spec, f"report.heldout_sources[{i}]")
