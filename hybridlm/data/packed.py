"""Read packed token shards (written by ``prepare``) and cut them into training / validation batches.

``PackedTokens`` memory-maps one split's shards after checking them against ``meta.json``.
``PackedBatches`` serves an endless, resumable, rank-sharded stream of ``seq_len + 1`` token windows.
``validation_batches`` returns a fixed, finite, unshuffled list of batches for evaluation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.data.prepare import FORMAT, FORMAT_VERSION, META, SPLITS, meta_digest, token_dtype
from hybridlm.data.sampler import ShuffledBatches, check_int, validation_indices
from hybridlm.utils.digest import sha256_of

DTYPES = ("uint16", "uint32")


def read_meta(path) -> Dict[str, Any]:
    """``path/meta.json`` parsed and checked for shape; ConfigError naming the file otherwise."""
    root = Path(path).expanduser()
    meta_file = root / META
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory (expected a dataset written by `python -m pretrain.prepare`)")
    if not meta_file.is_file():
        raise ConfigError(f"{meta_file}: missing (expected the meta.json that `python -m pretrain.prepare` writes "
                          f"last; the directory is not a complete prepared dataset)")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{meta_file}: not valid JSON ({e}); re-run prepare") from None

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConfigError(f"{meta_file}: expected {what}; the file is corrupt, re-run prepare")

    need(isinstance(meta, dict) and meta.get("format") == FORMAT, f'"format": "{FORMAT}"')
    need(meta.get("version") == FORMAT_VERSION, f'"version": {FORMAT_VERSION}, got {meta.get("version")!r}')
    need(meta.get("dtype") in DTYPES, f'"dtype" one of {", ".join(DTYPES)}, got {meta.get("dtype")!r}')
    tok = meta.get("tokenizer")
    need(isinstance(tok, dict) and isinstance(tok.get("vocab_size"), int) and isinstance(tok.get("eos_id"), int),
         '"tokenizer" with integer "vocab_size" and "eos_id"')
    vocab, eos = tok["vocab_size"], tok["eos_id"]
    need(vocab >= 2, f'tokenizer.vocab_size of at least 2, got {vocab}')
    need(0 <= eos < vocab, f'tokenizer.eos_id in [0, vocab_size={vocab}), got {eos}')
    need(meta["dtype"] == token_dtype(vocab),
         f'"dtype" {token_dtype(vocab)} for a vocabulary of {vocab} (what prepare writes), got {meta["dtype"]!r}')
    splits = meta.get("splits")
    need(isinstance(splits, dict) and all(s in splits for s in SPLITS), f'"splits" with {" and ".join(SPLITS)}')
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name in SPLITS:
        split = splits[name]
        need(isinstance(split, dict) and isinstance(split.get("shards"), list)
             and isinstance(split.get("num_tokens"), int), f'splits.{name} with "shards" and "num_tokens"')
        total = 0
        for i, sh in enumerate(split["shards"]):
            ok = isinstance(sh, dict) and isinstance(sh.get("file"), str) and isinstance(sh.get("num_tokens"), int) \
                and isinstance(sh.get("num_bytes"), int)
            need(ok, f"splits.{name}.shards[{i}] with file, num_tokens and num_bytes")
            rel = Path(sh["file"])
            need(not rel.is_absolute() and ".." not in rel.parts, f"splits.{name}.shards[{i}].file inside the dataset")
            need(sh["num_bytes"] == sh["num_tokens"] * itemsize,
                 f"splits.{name}.shards[{i}]: num_bytes = num_tokens * {itemsize}")
            total += sh["num_tokens"]
        need(total == split["num_tokens"], f"splits.{name}.num_tokens = the sum over its shards ({total})")
    if "digest" in meta and meta["digest"] != meta_digest(meta):
        raise ConfigError(f"{meta_file}: its content does not match the digest recorded in it (edited or corrupt); "
                          f"re-run prepare")
    return meta


class PackedTokens:
    """The concatenated token stream of one split (``train`` or ``val``), memory-mapped read-only.

    Every shard listed in meta.json must exist with exactly the recorded byte size (a truncated copy or an
    interrupted rsync is caught here, not as garbage mid-training); ``verify_checksums`` also re-hashes them
    against meta.json's sha256 (:func:`open_splits`, what training reads, does).
    """

    def __init__(self, path, split: str = "train", verify_checksums: bool = False):
        if split not in SPLITS:
            raise ConfigError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
        self.root = Path(path).expanduser()
        self.split = split
        self.meta = read_meta(self.root)
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        info = self.meta["splits"][split]
        self.num_docs = int(info.get("num_docs", 0))
        self.vocab_size = int(self.meta["tokenizer"]["vocab_size"])
        self.eos_id = int(self.meta["tokenizer"]["eos_id"])
        self._maps: List[np.memmap] = []
        self._files: List[Path] = []
        for sh in info["shards"]:
            f = self.root / sh["file"]
            if not f.is_file():
                raise ConfigError(f"{f}: missing (listed in {self.root / META}); re-run prepare")
            size = f.stat().st_size
            if size != sh["num_bytes"]:
                raise ConfigError(f"{f}: {size} bytes, expected {sh['num_bytes']} from meta.json "
                                  f"(truncated or modified); re-run prepare")
            if verify_checksums and sh.get("sha256"):
                if sha256_of(f) != sh["sha256"]:
                    raise ConfigError(f"{f}: its sha256 differs from the one in {self.root / META} (corrupt or "
                                      f"modified); re-run prepare")
            if sh["num_tokens"]:  # np.memmap cannot map an empty file
                self._maps.append(np.memmap(f, dtype=self.dtype, mode="r", shape=(sh["num_tokens"],)))
                self._files.append(f)
        self._starts = np.cumsum([0] + [m.shape[0] for m in self._maps])

    @property
    def name(self) -> str:
        return f"{self.root}[{self.split}]"

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, crossing shard boundaries as needed."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"{self.name}: range [{start}, {start + length}) outside [0, {len(self)})")
        out = np.empty(length, dtype=np.int64)
        done = 0
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while done < length:
            lo = start + done - int(self._starts[i])
            take = min(length - done, self._maps[i].shape[0] - lo)
            out[done:done + take] = self._maps[i][lo:lo + take]
            self._check_ids(out[done:done + take], i, lo)
            done += take
            i += 1
        return out

    def _check_ids(self, ids: np.ndarray, shard: int, offset: int) -> None:
        """Every id read must be in the tokenizer's vocabulary: a shard overwritten with garbage of the right
        size passes the size check and would otherwise fail deep inside the embedding lookup."""
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise ConfigError(f"{self._files[shard]}: token id {int(ids[bad[0]])} at token {offset + int(bad[0])} is "
                              f"outside the vocabulary [0, {self.vocab_size}) of meta.json (corrupt shard); "
                              f"re-run prepare")

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            arr = self.read(start, max(0, stop - start))
            return arr if step == 1 else arr[::step]
        i = int(idx) + (len(self) if int(idx) < 0 else 0)
        return int(self.read(i, 1)[0])




def _window_batch(tokens: PackedTokens, window_ids: np.ndarray, seq_len: int) -> Dict[str, torch.Tensor]:
    w = seq_len + 1
    arr = np.stack([tokens.read(int(i) * w, w) for i in window_ids])
    arr = torch.from_numpy(arr)
    return {"input_ids": arr[:, :-1].contiguous(), "labels": arr[:, 1:].contiguous()}


class PackedBatches(ShuffledBatches):
    """Endless iterator of ``{"input_ids", "labels"}`` LongTensors ``[micro_batch_size, seq_len]``.

    The stream is cut into ``num_windows`` non-overlapping windows of ``seq_len + 1`` tokens (inputs are
    ``w[:-1]``, labels ``w[1:]``), served by the shared shuffle / shard / resume policy of
    :class:`~hybridlm.data.sampler.ShuffledBatches`.
    """

    resume_hint = "resume with the same data, data.seq_len and seed"

    def __init__(self, tokens: PackedTokens, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        check_int("seq_len", seq_len, 1)
        self.tokens, self.seq_len = tokens, seq_len
        self.num_windows = len(tokens) // (seq_len + 1)
        if self.num_windows == 0:
            raise ConfigError(f"{tokens.name}: {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                              f"{seq_len + 1}; lower data.seq_len or add data")
        super().__init__(self.num_windows, micro_batch_size, rank, world_size, seed,
                         too_few=f"{tokens.name}: {self.num_windows} windows of {seq_len + 1} tokens")

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens trained on per epoch, all ranks together (the skipped tail excluded)."""
        return self.steps_per_epoch * self.global_batch * self.seq_len

    def make_batch(self, indices: np.ndarray) -> Dict[str, torch.Tensor]:
        return _window_batch(self.tokens, indices, self.seq_len)

    def identity(self) -> Dict[str, Any]:
        return {"seed": self.seed, "seq_len": self.seq_len, "num_windows": self.num_windows}


def validation_batches(tokens: PackedTokens, seq_len: int, micro_batch_size: int, max_batches: int,
                       rank: int = 0, world_size: int = 1) -> List[Dict[str, torch.Tensor]]:
    """At most ``max_batches`` batches of the split's leading windows, in order, the same on every call.

    Ranks share each global batch as in training. When the split is small the per-rank batch shrinks so
    that every rank still gets the same number (>= 1) of equal batches.
    """
    check_int("seq_len", seq_len, 1)
    num_windows = len(tokens) // (seq_len + 1)
    plan = validation_indices(num_windows, micro_batch_size, max_batches, rank, world_size,
                              f"{tokens.name}: {len(tokens)} tokens make {num_windows} windows of {seq_len + 1}, "
                              f"fewer than one per rank ({world_size}); lower data.seq_len or raise val_fraction")
    return [_window_batch(tokens, idx, seq_len) for idx in plan]


def open_splits(path, seq_len: int, micro_batch_size: int, val_max_batches: int, rank: int = 0,
                world_size: int = 1, seed: int = 0) -> Tuple[PackedBatches, List[Dict[str, torch.Tensor]]]:
    """(training batch iterator, validation batch list) of a prepared dataset directory, every shard checked
    against the sha256 that meta.json records (hashing runs at well over 1 GB/s)."""
    train = PackedBatches(PackedTokens(path, "train", verify_checksums=True), seq_len, micro_batch_size, rank,
                          world_size, seed)
    val = validation_batches(PackedTokens(path, "val", verify_checksums=True), seq_len, micro_batch_size,
                             val_max_batches, rank, world_size)
    return train, val


def heldout_windows(data_path, seq_len: int, max_tokens: int) -> List[torch.Tensor]:
    """Consecutive ``seq_len + 1`` token windows from the validation split, at most ``max_tokens`` targets."""
    tokens = PackedTokens(data_path, "val")
    n = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    if n < 1:
        raise ConfigError(f"{data_path}: the validation split has fewer than {seq_len + 1} tokens")
    stream = np.asarray(tokens.read(0, n * seq_len + 1), dtype=np.int64)
    return [torch.from_numpy(stream[i * seq_len:(i + 1) * seq_len + 1].copy()) for i in range(n)]
