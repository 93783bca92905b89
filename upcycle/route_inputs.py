"""Every input the route reads, checked before its first stage: the teacher, each stage's data sources or files,
the calibration and held-out sources. A missing one is one ConfigError naming the key, found in a second instead
of after init and ILD have run. Nothing is fetched here: an ``asset:`` name only has to be known."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from hybridlm.config.errors import ConfigError
from hybridlm.data.assets import ASSET_PREFIX, asset_names
from hybridlm.data.config import source_entries
from hybridlm.data.prepare import META, SPLIT_RULE
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


def _same_paths(paths: Iterable[str]) -> set:
    return {str(Path(p).expanduser().resolve()) for p in paths}


def check_packed(data, where: str, prepared_by: Iterable[str] = (), produced: Iterable[str] = ()) -> None:
    """A packed data section: already prepared, prepared by an earlier stage, or sources that exist or that an
    earlier stage writes (``produced``: the route's teacher samples)."""
    path = Path(data.path).expanduser()
    if (path / META).is_file() or str(path.resolve()) in _same_paths(prepared_by):
        return
    if not data.sources:
        raise ConfigError(f"{where}.path: {path / META} does not exist and {where}.sources is empty")
    written_by_the_route = _same_paths(produced)
    for i, (spec, _) in enumerate(source_entries(data.sources, f"{where}.sources")):
        if str(Path(spec).expanduser().resolve()) not in written_by_the_route:
            check_source(spec, f"{where}.sources[{i}]")


def check_split_rule(ild, kd) -> None:
    """A KD mix prepared from sources beside the ILD data (e.g. the ILD mix plus teacher samples) keeps the ILD
    data's validation documents out of its training split only when both split source by source
    (hybridlm.data.prepare._split_docs); ILD data prepared by an older version of the toolkit split the whole
    mix at once, and is refused here rather than leaking the report's held-out text (a) into KD."""
    if not kd.sources or Path(kd.path).expanduser() == Path(ild.path).expanduser():
        return
    for key in ("val_fraction", "seed", "txt_split", "text_field"):  # what else decides a shared document's split
        if getattr(kd, key) != getattr(ild, key):
            raise ConfigError(f"kd.data.{key}: {getattr(kd, key)!r}, but ild.data.{key} is {getattr(ild, key)!r}; a KD "
                              f"mix prepared beside the ILD data splits alike only with the same {key}")
    meta = Path(ild.path).expanduser() / META
    if not meta.is_file():
        return
    try:
        rule = json.loads(meta.read_text(encoding="utf-8")).get("params", {}).get("split")
    except (OSError, ValueError, AttributeError):
        return  # a damaged meta.json is reported with its own message when the data is opened
    if rule != SPLIT_RULE:
        raise ConfigError(f"ild.data.path: {meta.parent} was prepared with one split of the whole mix, so KD's mix "
                          f"of its sources ({kd.path}) could train on its validation text; delete {meta.parent} to "
                          f"prepare it again with per-source splits")


def check_record_file(spec: str, where: str) -> None:
    check_source(spec, where)
    if not spec.startswith(ASSET_PREFIX) and not Path(spec).expanduser().is_file():
        raise ConfigError(f"{where}: {spec!r} is not a file (expected a .json / .jsonl file or an asset: name)")


def check_route_inputs(teacher: str, built: Dict[str, Dict[str, Any]], calib_sources: Iterable[str],
                       heldout_sources: Optional[Iterable[str]] = (), produced: Iterable[str] = ()) -> None:
    """``built``: the route's checked stage sections (``ild``, ``kd``, [``long_context``], ``dpo``); ``produced``: the
    directories an earlier stage writes, which a later stage's sources may name (the teacher samples)."""
    check_teacher(teacher)
    ild = built["ild"]["data"]
    check_packed(ild, "ild.data")
    for i, spec in enumerate(calib_sources or ()):
        if str(Path(spec).expanduser()) != str(Path(ild.path).expanduser()):  # the ILD data is prepared first
            check_source(spec, f"init.calib_sources[{i}]")
    kd = built["kd"]["data"]
    if hasattr(kd, "sources"):
        check_packed(kd, "kd.data", prepared_by=[ild.path], produced=produced)
        check_split_rule(ild, kd)
    else:
        check_record_file(kd.path, "kd.data.path")
    if "long_context" in built:
        check_packed(built["long_context"]["data"], "long_context.data", prepared_by=[ild.path, kd.path])
    check_record_file(built["dpo"]["data"].path, "dpo.data.path")
    for i, spec in enumerate(heldout_sources or ()):
        check_source(spec, f"report.heldout_sources[{i}]")
