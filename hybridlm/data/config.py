"""``DataConfig``: where the packed tokens live, the window length, and how to prepare them if missing."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from hybridlm.config.errors import ConfigError

TXT_SPLITS = ("file", "paragraphs")
DEFAULT_SHARD_TOKENS = 100_000_000  # 400 MB per shard at uint32
SOURCE_KEYS = ("source", "max_tokens")

# A source: a path / dataset name / asset name, or {source: ..., max_tokens: N} to cap what it contributes.
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
    return src, cap


def source_entries(sources: Sequence[Any], where: str = "sources") -> List[Tuple[str, Optional[int]]]:
    """Every entry of ``sources`` as ``(source, max_tokens or None)``."""
    if not isinstance(sources, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of file paths, dataset names or {{source, max_tokens}} "
                          f"entries, got {sources!r}")
    return [source_entry(e, f"{where}[{i}]") for i, e in enumerate(sources)]


@dataclass
class DataConfig:
    """The ``data:`` section of a run config.

    ``path`` is a directory written by ``prepare`` (``meta.json`` + ``{train,val}/shard_*.bin``).
    When ``sources`` is non-empty and ``path`` holds no prepared data yet, ``ensure_prepared`` builds it
    from ``sources`` with ``tokenizer`` (``asset:llama3.2`` / ``asset:janeausten`` name fetched assets).
    An entry of ``sources`` is a string, or ``{source: asset:linuxdoc, max_tokens: 4000000}`` to take at
    most that many tokens (by ``tokenizer``, EOS included) of whole documents from it.
    """

    path: str = ""
    seq_len: int = 1024
    val_max_batches: int = 20
    sources: List[Any] = field(default_factory=list)  # SourceEntry items, checked by validate()
    tokenizer: str = "asset:llama3.2"
    val_fraction: float = 0.05
    num_proc: int = 1
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    text_field: str = "text"
    txt_split: str = "file"  # "file": a .txt file is one document; "paragraphs": one per blank-line block
    seed: int = 1234  # train/val document split and window shuffling

    def validate(self, where: str = "data") -> None:
        """Raise ConfigError naming the first bad field."""
        if not isinstance(self.path, str) or not self.path.strip():
            raise ConfigError(f"{where}.path: expected the directory of a prepared dataset, got {self.path!r}")
        for name, low in (("seq_len", 1), ("val_max_batches", 1), ("num_proc", 1), ("shard_tokens", 1)):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < low:
                raise ConfigError(f"{where}.{name}: expected an integer >= {low}, got {val!r}")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) \
                or not 0.0 < float(self.val_fraction) < 1.0:
            raise ConfigError(f"{where}.val_fraction: expected a number strictly between 0 and 1, got {self.val_fraction!r}")
        if self.txt_split not in TXT_SPLITS:
            raise ConfigError(f"{where}.txt_split: expected one of {', '.join(TXT_SPLITS)}, got {self.txt_split!r}")
        source_entries(self.sources, f"{where}.sources")
        if self.sources and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ConfigError(f"{where}.tokenizer: expected a tokenizer.json path or directory, got {self.tokenizer!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"{where}.text_field: expected a field name, got {self.text_field!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"{where}.seed: expected an integer, got {self.seed!r}")
