"""``DataConfig``: where the packed tokens live, the window length, and how to prepare them if missing."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from hybridlm.config.errors import ConfigError

TXT_SPLITS = ("file", "paragraphs")
DEFAULT_SHARD_TOKENS = 100_000_000  # 400 MB per shard at uint32


@dataclass
class DataConfig:
    """The ``data:`` section of a run config.

    ``path`` is a directory written by ``prepare`` (``meta.json`` + ``{train,val}/shard_*.bin``).
    When ``sources`` is non-empty and ``path`` holds no prepared data yet, ``ensure_prepared`` builds it
    from ``sources`` with ``tokenizer`` (``asset:llama3.2`` / ``asset:janeausten`` name fetched assets).
    """

    path: str = ""
    seq_len: int = 1024
    val_max_batches: int = 20
    sources: List[str] = field(default_factory=list)
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
        if not isinstance(self.sources, (list, tuple)) or not all(isinstance(s, str) and s for s in self.sources):
            raise ConfigError(f"{where}.sources: expected a list of file paths or dataset names, got {self.sources!r}")
        if self.sources and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ConfigError(f"{where}.tokenizer: expected a tokenizer.json path or directory, got {self.tokenizer!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"{where}.text_field: expected a field name, got {self.text_field!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"{where}.seed: expected an integer, got {self.seed!r}")
