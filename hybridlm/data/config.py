"""``DataConfig``: where the packed tokens live, the window length, and how to prepare them if missing."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting

TXT_SPLITS = ("file", "paragraphs")
DEFAULT_SHARD_TOKENS = 100_000_000  # 400 MB per shard at uint32
SOURCE_KEYS = ("source", "max_tokens", "weight")

# A source: a path / dataset name / asset name, or {source: ..., max_tokens: N, weight: W} to cap what it
# contributes and to count its training documents W times (2: each twice; 0.5: a seeded half).
SourceEntry = Union[str, Dict[str, Any]]


def source_entry(entry: Any, where: str) -> Tuple[str, Optional[int]]:
    """``(source, max_tokens or None)`` of one ``sources`` entry; ConfigError naming ``where`` otherwise."""
    if isinstance(entry, str):
        if not entry:
            raise ConfigError(f"{where}: expected a file path, dataset or asset name, got ''")
        return entry, None
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a path / dataset name or {{source: ..., max_tokens: N}}, got {entry!r}")
    unknown = sorted(set(entry) - set(SOURCE_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(SOURCE_KEYS)})")
    src, cap = entry.get("source"), entry.get("max_tokens")
    if not isinstance(src, str) or not src:
        raise ConfigError(f"{where}.source: expected a file path, dataset or asset name, got {src!r}")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(f"{where}.max_tokens: expected an integer >= 1, got {cap!r}")
    source_weight(entry, where)
    return src, cap


def source_weight(entry: Any, where: str = "source") -> float:
    """The ``weight`` of one ``sources`` entry (1 for a plain name): how many times each of its training
    documents is counted in the prepared mix (the fraction by a seeded draw per document)."""
    weight = entry.get("weight", 1.0) if isinstance(entry, dict) else 1.0
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1000:
        raise ConfigError(f"{where}.weight: expected a number in (0, 1000] (2: each training document twice, "
                          f"0.5: a seeded half of them), got {weight!r}")
    return float(weight)


def source_entries(sources: Sequence[Any], where: str = "sources") -> List[Tuple[str, Optional[int]]]:
    """Every entry of ``sources`` as ``(source, max_tokens or None)``."""
    if not isinstance(sources, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of file paths, dataset names or {{source, max_tokens}} "
                          f"entries, got {sources!r}")
    return [source_entry(e, f"{where}[{i}]") for i, e in enumerate(sources)]


@dataclass
class DataConfig(Section):
    """The ``data:`` section of a run config.

    ``path`` is a directory written by ``prepare`` (``meta.json`` + ``{train,val}/shard_*.bin``).
    When ``sources`` is non-empty and ``path`` holds no prepared data yet, ``ensure_prepared`` builds it
    from ``sources`` with ``tokenizer`` (``asset:llama3.2`` / ``asset:janeausten`` name fetched assets).
    An entry of ``sources`` is a string, or ``{source: asset:linuxdoc, max_tokens: 4000000, weight: 2}`` to take
    at most that many tokens (by ``tokenizer``, EOS included) of whole documents from it, and to count each of its
    training documents twice (validation documents are never repeated).
    """

    path: str = setting("", nonempty="the directory of a prepared dataset")
    seq_len: int = setting(1024, ge=1)
    val_max_batches: int = setting(20, ge=1)
    sources: List[Any] = field(default_factory=list)  # SourceEntry items, checked by validate()
    tokenizer: str = "asset:llama3.2"
    val_fraction: float = setting(0.05, gt=0, lt=1)
    num_proc: int = setting(1, ge=1)
    shard_tokens: int = setting(DEFAULT_SHARD_TOKENS, ge=1)
    text_field: str = setting("text", nonempty="a field name")
    # "file": a .txt file is one document; "paragraphs": one per blank-line block
    txt_split: str = setting("file", choices=TXT_SPLITS)
    seed: int = 1234  # train/val document split and window shuffling

    def validate(self, where: str = "data") -> None:
        """The schema, the sources, and a tokenizer when there are sources."""
        super().validate(where)
        source_entries(self.sources, f"{where}.sources")
        if self.sources and not self.tokenizer:
            raise ConfigError(f"{where}.tokenizer: expected a tokenizer.json path or directory, got {self.tokenizer!r}")
