"""Windows that stay inside one document: training data for a long-context stage.

Packed data (``hybrid-prepare``; :mod:`hybridlm.data.packed`) is every document's tokens followed by ``eos_id``,
concatenated; :class:`~hybridlm.data.packed.PackedBatches` cuts that stream into windows wherever they fall, so a
window may hold the end of one document and the start of the next. A stage that teaches a longer context needs
windows that are one document throughout: :class:`DocumentWindows` finds the documents (the spans between EOS
tokens, each with its EOS) and cuts each one of at least ``seq_len + 1`` tokens into consecutive, non-overlapping
``seq_len + 1`` token windows from its start; shorter documents and each document's tail are left out. The batches
come from the shared shuffle / shard / resume policy (:class:`~hybridlm.data.sampler.ShuffledBatches`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.data.config import DataConfig
from hybridlm.data.packed import PackedTokens
from hybridlm.data.sampler import ShuffledBatches, check_int, validation_indices


@dataclass
class DocumentDataConfig(DataConfig):
    """A :class:`~hybridlm.data.DataConfig` whose windows never cross a document boundary (``format: documents``
    in a KD ``data:`` section)."""


def document_spans(tokens: PackedTokens) -> np.ndarray:
    """``[num_docs, 2]`` (start, end) of every document of the split, its EOS included (``end`` exclusive)."""
    ends, offset = [], 0
    for m in tokens._maps:
        ends.append(np.flatnonzero(np.asarray(m) == tokens.eos_id) + offset + 1)
        offset += m.shape[0]
    ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    if len(ends) == 0 or ends[-1] != len(tokens):  # a stream not ending in EOS: its last document still counts
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]])
    spans = np.stack([starts, ends], axis=1).astype(np.int64)
    return spans[spans[:, 1] > spans[:, 0]]


def window_starts(spans: np.ndarray, seq_len: int) -> np.ndarray:
    """The first token of every ``seq_len + 1`` window that fits inside one document, documents in order."""
    w = seq_len + 1
    counts = (spans[:, 1] - spans[:, 0]) // w
    if counts.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    doc = np.repeat(np.arange(len(spans)), counts)
    first = np.cumsum(counts) - counts  # index of each document's first window
    return spans[doc, 0] + (np.arange(len(doc)) - first[doc]) * w


def _batch(tokens: PackedTokens, starts: np.ndarray, seq_len: int) -> Dict[str, torch.Tensor]:
    arr = torch.from_numpy(np.stack([tokens.read(int(s), seq_len + 1) for s in starts]))
    return {"input_ids": arr[:, :-1].contiguous(), "labels": arr[:, 1:].contiguous()}


def _starts_or_error(tokens: PackedTokens, seq_len: int) -> Tuple[np.ndarray, int]:
    check_int("seq_len", seq_len, 1)
    spans = document_spans(tokens)
    starts = window_starts(spans, seq_len)
    if len(starts) == 0:
        longest = int((spans[:, 1] - spans[:, 0]).max()) if len(spans) else 0
        raise ConfigError(f"{tokens.name}: no document has seq_len + 1 = {seq_len + 1} tokens (the longest of its "
                          f"{len(spans)} has {longest}); lower data.seq_len or add longer documents")
    return starts, len(spans)


class DocumentWindows(ShuffledBatches):
    """Endless, resumable ``{"input_ids", "labels"}`` batches ``[micro_batch_size, seq_len]`` of windows that each
    lie inside one document (module docstring)."""

    resume_hint = "resume with the same data, data.seq_len and seed"

    def __init__(self, tokens: PackedTokens, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        self.tokens, self.seq_len = tokens, seq_len
        self.starts, self.num_docs_used = _starts_or_error(tokens, seq_len)
        super().__init__(len(self.starts), micro_batch_size, rank, world_size, seed,
                         too_few=f"{tokens.name}: {len(self.starts)} in-document windows of {seq_len + 1} tokens")

    @property
    def tokens_per_epoch(self) -> int:
        return self.steps_per_epoch * self.global_batch * self.seq_len

    def make_batch(self, indices: np.ndarray) -> Dict[str, torch.Tensor]:
        return _batch(self.tokens, self.starts[indices], self.seq_len)

    def identity(self) -> Dict[str, Any]:
        return {"seed": self.seed, "seq_len": self.seq_len, "num_windows": len(self.starts), "windows": "documents"}


def document_validation_batches(tokens: PackedTokens, seq_len: int, micro_batch_size: int, max_batches: int,
                                rank: int = 0, world_size: int = 1) -> List[Dict[str, torch.Tensor]]:
    """The validation policy of :func:`hybridlm.data.packed.validation_batches` over in-document windows."""
    starts, _ = _starts_or_error(tokens, seq_len)
    plan = validation_indices(len(starts), micro_batch_size, max_batches, rank, world_size,
                              f"{tokens.name}: {len(starts)} in-document windows of {seq_len + 1} tokens, fewer than "
                              f"one per rank ({world_size}); raise data.val_fraction or lower data.seq_len")
    return [_batch(tokens, starts[idx], seq_len) for idx in plan]


def open_document_splits(path, seq_len: int, micro_batch_size: int, val_max_batches: int, rank: int = 0,
                         world_size: int = 1, seed: int = 0) -> Tuple[DocumentWindows, List[Dict[str, torch.Tensor]]]:
    """(training batches, validation batches) of in-document windows of a prepared dataset, shards checked against
    meta.json's sha256 as :func:`hybridlm.data.packed.open_splits` does."""
    train = DocumentWindows(PackedTokens(path, "train", verify_checksums=True), seq_len, micro_batch_size, rank,
                            world_size, seed)
    val = document_validation_batches(PackedTokens(path, "val", verify_checksums=True), seq_len, micro_batch_size,
                                      val_max_batches, rank, world_size)
    return train, val
