"""Real record files for the upcycling route's SFT, preference and text stages, from a pinned PyPI source
distribution: LLaMA-Factory's demo data sets (Apache-2.0), shipped in the sdist of ``llamafactory==0.9.5``.

A config names one as ``asset:<name>`` wherever it takes a data file (``kd.data.path``, ``dpo.data.path``,
a ``sources`` entry). The sdist is pinned by the sha256 of the downloaded file, each member by its own sha256;
the members land under ``$HYBRIDLM_CACHE/records/<package>-<version>/`` and are hashed again on every use,
so a file changed in the cache is refetched instead of being trained on.
"""
from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from hybridlm.data.cache import AssetError, atomic_build, cache_dir
from hybridlm.data.packages import Package, fetch_packages
from hybridlm.utils.digest import sha256_of

LLAMAFACTORY = Package("pypi-sdist", "llamafactory", "0.9.5",
                       "1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f")


@dataclass(frozen=True)
class RecordSet:
    name: str
    what: str
    member: str  # path inside the unpacked package
    sha256: str
    package: Package = LLAMAFACTORY
    license: str = "Apache-2.0"

    @property
    def file_name(self) -> str:
        return Path(self.member).name


RECORD_SETS: Dict[str, RecordSet] = {r.name: r for r in (
    RecordSet("alpaca_en_demo", "999 English instruction / input / output records (alpaca layout), for SFT",
              "llamafactory-0.9.5/data/alpaca_en_demo.json",
              "bcc37c64db1a739a0789a1b81f251146fcf4459f903474bc9e3c21bbb5628318"),
    RecordSet("dpo_en_demo", "300 English preference pairs (ShareGPT layout: conversations, chosen, rejected)",
              "llamafactory-0.9.5/data/dpo_en_demo.json",
              "b949be2421cfa62744afcf1b479f95b299d643d1a4c1c97d1341b314a1aa5cb3"),
    RecordSet("c4_demo", "300 English web documents from C4 (JSON lines, one `text` each)",
              "llamafactory-0.9.5/data/c4_demo.jsonl",
              "f51528081ef22279f2840c02c4cd7cdfc372138be0817c5b8714d200af692b78"),
)}


def _package_dir(pkg: Package) -> Path:
    return cache_dir() / "records" / f"{pkg.name}-{pkg.version}"


def _build(pkg: Package, out: Path) -> None:
    """Every record set of ``pkg``: fetched once, each member checked against its pin."""
    work = out.parent / "work"
    root = fetch_packages(f"{pkg.name} records", [pkg], work)[pkg.name]
    for rec in (r for r in RECORD_SETS.values() if r.package == pkg):
        src = root / rec.member
        if not src.is_file():
            raise AssetError(f"asset:{rec.name} fetch: {pkg.label} has no {rec.member}")
        got = sha256_of(src)
        if got != rec.sha256:
            raise AssetError(f"asset:{rec.name} fetch: {rec.member} of {pkg.label} has sha256 {got}, expected the "
                             f"pinned {rec.sha256}; not using it")
        shutil.copyfile(src, out / rec.file_name)
    shutil.rmtree(work)


def record_file(name: str, fetch: bool = True) -> Path:
    """The file of record set ``name``, fetched on first use and checked against its sha256 on every use."""
    rec = RECORD_SETS[name]
    final = _package_dir(rec.package)
    path = final / rec.file_name
    if not fetch:
        return path
    if final.is_dir() and not (path.is_file() and sha256_of(path) == rec.sha256):
        stale = final.with_name(f".{final.name}.bad-{uuid.uuid4().hex[:8]}")  # changed in the cache: refetch
        try:
            final.rename(stale)
        except OSError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    atomic_build(final, lambda out: _build(rec.package, out))
    return path
