"""Tokenize text sources into packed token shards: ``out_dir/{train,val}/shard_NNNNN.bin`` + ``meta.json``.

Sources (a list; directories are walked recursively in sorted order):

* ``.txt`` -- with ``txt_split="file"`` (default) each file is one document; with ``"paragraphs"`` every
  block separated by blank lines is one document (for files that are collections of short texts).
* ``.json`` (a list of records, or JSON lines) and ``.jsonl`` -- one document per record: the string in
  ``text_field`` (default ``text``), or for alpaca-style records ``instruction``, ``input`` and
  ``output`` joined by blank lines.
* ``.parquet`` -- the ``text_field`` column (or alpaca-style columns).
* anything else that is not an existing path -- a ``datasets`` dataset name (``hf:NAME[:CONFIG]`` or
  plain ``NAME``), its ``train`` split, loaded with ``datasets.load_dataset``.
* ``asset:<corpus>`` (``asset:janeausten``, ``asset:kjv``, ``asset:pydoc``, ...) -- a corpus fetched by
  ``hybridlm.data.corpora``.

An entry may also be ``{source: ..., max_tokens: N}``: that source then contributes whole documents, in a
fixed order, up to the first one that would take it past N tokens (counted with the tokenizer being
prepared with, each document's EOS included). A capped directory's files are visited in an order shuffled
with ``seed``, so that a cap samples across the whole directory rather than its alphabetical head.

Every document is tokenized without special tokens (a literal ``<|end_of_text|>`` in the text stays
plain text) and followed by the EOS token. Documents, not tokens, are split into train / val, so no
document straddles the two. Shards are raw little-endian ``uint16`` (vocab <= 65535) or ``uint32``
arrays that ``np.memmap`` opens directly; ``meta.json`` records their sizes and sha256, and its own digest
(:func:`meta_digest`); readers check all three.

The output is built in a hidden temp dir beside ``out_dir`` and renamed into place at the end, so an
interrupted run never leaves a directory with a ``meta.json`` that is not complete.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from hybridlm import patches
from hybridlm.config.errors import ConfigError
from hybridlm.data import assets
from hybridlm.data.config import DEFAULT_SHARD_TOKENS, DataConfig, source_entries, source_weight
from hybridlm.utils.atomic import json_text, write_json
from hybridlm.utils.faults import kill_in

FORMAT = "hybridlm-packed-tokens"
FORMAT_VERSION = 1
META = "meta.json"
SPLITS = ("train", "val")
# how documents are split (_split_docs); recorded, so that mixes sharing sources can be checked for leaks
SPLIT_RULE = "per_source"
TEXT_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet")
ALPACA_FIELDS = ("instruction", "input", "output")


def meta_digest(meta: Dict[str, Any]) -> str:
    """sha256 of ``meta.json``'s content without its own ``digest`` entry (keys sorted): recorded as
    ``digest``, so that any edit of the file (a dtype, a vocabulary size, a shard's hash) is caught at load."""
    body = {k: v for k, v in meta.items() if k not in ("digest", "path")}
    return hashlib.sha256(json_text(body, sort_keys=True).encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------------------- sources
def _source_files(spec: str) -> List[Path]:
    """Files of one local source, or [] when ``spec`` names a ``datasets`` dataset instead."""
    p = Path(spec).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise ConfigError(f"source {spec!r}: directory has no {'/'.join(TEXT_SUFFIXES)} files")
        return files
    if p.is_file():
        if p.suffix.lower() not in TEXT_SUFFIXES:
            raise ConfigError(f"source {spec!r}: expected a {'/'.join(TEXT_SUFFIXES)} file")
        return [p]
    if spec.startswith("hf:"):
        return []
    if p.suffix.lower() in TEXT_SUFFIXES or spec.startswith((".", "/", "~")):
        raise ConfigError(f"source {spec!r}: no such file or directory")
    return []  # treated as a dataset name


def _record_text(rec: Any, text_field: str, where: str) -> str:
    if isinstance(rec, dict):
        val = rec.get(text_field)
        if isinstance(val, str):
            return val
        if val is None and all(k in rec for k in ("instruction", "output")):
            return "\n\n".join(str(rec[k]).strip() for k in ALPACA_FIELDS if rec.get(k) and str(rec[k]).strip())
    raise ConfigError(f"{where}: expected a record with a string field {text_field!r} "
                      f"(or alpaca instruction/input/output); set text_field to the right name")


def _json_records(path: Path) -> Iterator[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if "Extra data" not in str(e):  # not JSON lines in disguise either
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        else:
            if isinstance(data, dict):  # {"data": [...]} style containers
                lists = [v for v in data.values() if isinstance(v, list)]
                data = lists[0] if len(lists) == 1 else [data]
            if not isinstance(data, list):
                raise ConfigError(f"{path}: expected a JSON list of records")
            yield from data
            return
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e})") from None


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    cols = [text_field] if text_field in names else [c for c in ALPACA_FIELDS if c in names]
    if text_field not in names and not {"instruction", "output"} <= set(cols):
        raise ConfigError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set text_field")
    for batch in pf.iter_batches(columns=cols, batch_size=1024):
        for rec in batch.to_pylist():
            yield _record_text(rec, text_field, str(path))


def _dataset_texts(spec: str, text_field: str) -> Iterator[str]:
    import datasets

    name, _, config = spec[3:].partition(":") if spec.startswith("hf:") else (spec, "", "")
    try:
        ds = datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # network, unknown name, bad config: all one message for the user
        raise ConfigError(f"source {spec!r}: not a local file and not loadable as a datasets dataset "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    for i, rec in enumerate(ds):
        yield _record_text(rec, text_field, f"source {spec!r} row {i}")


def iter_documents(sources: Sequence[Any], text_field: str = "text", txt_split: str = "file",
                   tokenizer_file: Optional[str] = None, seed: int = 1234) -> Iterator[str]:
    """Every non-blank document of ``sources``, in order (see the module docstring for the formats and for
    ``{source, max_tokens}`` entries, which need ``tokenizer_file`` to count tokens)."""
    for _, text in _source_documents(sources, text_field, txt_split, tokenizer_file, seed):
        yield text


def _source_documents(sources: Sequence[Any], text_field: str, txt_split: str, tokenizer_file: Optional[str],
                      seed: int) -> Iterator[Tuple[int, str]]:
    """``(index of the source, document)`` for every kept document of ``sources``."""
    for i, (spec, cap) in enumerate(source_entries(sources)):
        spec = assets.resolve_source(spec)
        files = _source_files(spec)
        if cap is not None and len(files) > 1:
            files = [files[j] for j in np.random.default_rng(seed).permutation(len(files))]
        texts: Iterator[str]
        if not files:
            texts = _dataset_texts(spec, text_field)
        else:
            texts = (t for f in files for t in _file_texts(f, text_field, txt_split))
        texts = (t for t in texts if t.strip())
        if cap is not None:
            if tokenizer_file is None:
                raise ConfigError(f"sources[{i}]: max_tokens needs a tokenizer to count tokens with")
            texts = _capped(texts, cap, tokenizer_file, f"sources[{i}] ({spec})")
        for text in texts:
            yield i, text


def _capped(texts: Iterator[str], cap: int, tokenizer_file: str, what: str) -> Iterator[str]:
    """Whole documents of ``texts`` while they fit in ``cap`` tokens (EOS included), stopping at the first
    that does not (a stream is never read further than needed); what ``prepare`` writes of them is exactly
    the counted tokens. ConfigError when not even the first document fits."""
    tok = _raw_tokenizer(tokenizer_file)
    used = 0
    for text in texts:
        n = len(tok.encode(text, add_special_tokens=False).ids) + 1
        if used + n > cap:
            if used == 0:
                raise ConfigError(f"{what}: max_tokens {cap} is less than its first document ({n} tokens); "
                                  f"raise the cap")
            return
        used += n
        yield text


def _file_texts(path: Path, text_field: str, txt_split: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            text = path.read_text(encoding="utf-8")
            yield from (re.split(r"\n[ \t]*\n", text) if txt_split == "paragraphs" else [text])
        elif suffix == ".parquet":
            yield from _parquet_texts(path, text_field)
        else:
            for i, rec in enumerate(_json_records(path)):
                yield _record_text(rec, text_field, f"{path} record {i}")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: expected UTF-8 text ({e.reason} at byte {e.start})") from None


def _gen_documents(sources_json: str, text_field: str, txt_split: str, tokenizer_file: str, seed: int):
    """Generator for ``Dataset.from_generator`` (module level so it pickles). The sources come as one JSON
    string: ``datasets`` would split a list argument into shards, one generator call per source."""
    sources = json.loads(sources_json)
    for i, text in _source_documents(sources, text_field, txt_split, tokenizer_file, seed):
        yield {"text": text, "src": i}


# ------------------------------------------------------------------------------------ tokenization
_TOKENIZERS: Dict[str, Any] = {}


def _raw_tokenizer(tokenizer_file: str):
    """The raw ``tokenizers`` backend of ``tokenizer_file``, loaded once per process, with special-token
    matching off so text cannot inject a fake EOS."""
    tok = _TOKENIZERS.get(tokenizer_file)
    if tok is None:
        tok = Tokenizer.from_file(tokenizer_file)
        tok.encode_special_tokens = True
        _TOKENIZERS[tokenizer_file] = tok
    return tok


_PREPARING_PID = 0  # the process running prepare(); its forked tokenizer workers inherit it


def _die_with_the_preparing_process() -> None:
    """In a forked tokenizer worker: ask the kernel to SIGKILL it when the process running ``prepare`` dies
    (``PR_SET_PDEATHSIG``), so that a killed ``prepare`` leaves no orphaned workers. Once per process."""
    global _DEATH_SIGNAL_SET
    if _DEATH_SIGNAL_SET or not _PREPARING_PID or os.getpid() == _PREPARING_PID:
        return
    _DEATH_SIGNAL_SET = True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if os.getppid() != _PREPARING_PID:  # it died before the request was made
        os._exit(1)


_DEATH_SIGNAL_SET = False


def _children_die_with_this_process():
    """Every process that ``multiprocess`` / ``multiprocessing`` starts from here (``datasets``' tokenizer pool
    and its manager process) first asks to be killed when this process dies
    (:func:`_die_with_the_preparing_process`; hybridlm/patches.py ``children-run-first``)."""
    return patches.scope("children-run-first", _die_with_the_preparing_process)


def _remove_abandoned_temporaries(out: Path) -> None:
    """Delete ``.<out>.tmp-<pid>-*`` dirs of earlier prepares whose process is gone (killed part-way)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        m = re.match(rf"^\.{re.escape(out.name)}\.tmp-(\d+)-", stale.name)
        if m and _alive(int(m.group(1))):
            continue
        shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tokenize_batch(batch: Dict[str, list], tokenizer_file: str, eos_id: int, dtype: str) -> Dict[str, list]:
    """``datasets.map`` worker: ids of each text + EOS (see ``_raw_tokenizer``)."""
    _die_with_the_preparing_process()
    if _PREPARING_PID:
        kill_in("prepare", pid=_PREPARING_PID)  # reliability drills: the preparing process dies mid-tokenize
    tok = _raw_tokenizer(tokenizer_file)
    limit = np.iinfo(dtype).max
    out = []
    for enc in tok.encode_batch(batch["text"], add_special_tokens=False):
        ids = np.asarray(enc.ids + [eos_id], dtype=np.int64)
        if ids.size and int(ids.max()) > limit:  # would wrap around silently in the shard dtype
            raise ConfigError(f"tokenizer {tokenizer_file}: token id {int(ids.max())} does not fit {dtype}")
        out.append(ids.astype(dtype))
    return {"input_ids": out}


def token_dtype(vocab_size: int) -> str:
    """Smallest shard dtype for a vocabulary: uint16 up to 65535 entries, else uint32."""
    return "uint16" if vocab_size <= 65535 else "uint32"


# ----------------------------------------------------------------------------------------- writing
class _ShardWriter:
    """Appends token arrays to ``<split>/shard_NNNNN.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, root: Path, split: str, dtype: str, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, np.dtype(dtype), shard_tokens
        (root / split).mkdir(parents=True, exist_ok=True)
        self.shards: List[Dict[str, Any]] = []
        self._fh = None
        self._n = 0
        self._sha = None

    def _open(self) -> None:
        name = f"{self.split}/shard_{len(self.shards):05d}.bin"
        self._fh = open(self.root / name, "wb")
        self._sha, self._n = hashlib.sha256(), 0
        self.shards.append({"file": name})

    def _close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self.shards[-1].update(num_tokens=self._n, num_bytes=self._n * self.dtype.itemsize,
                                   sha256=self._sha.hexdigest())
            self._fh = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=self.dtype.newbyteorder("<"))
        while ids.size:
            if self._fh is None:
                self._open()
            take = ids[: self.shard_tokens - self._n]
            buf = take.tobytes()
            self._fh.write(buf)
            self._sha.update(buf)
            self._n += take.size
            ids = ids[take.size:]
            if self._n >= self.shard_tokens:
                self._close()

    def finish(self) -> List[Dict[str, Any]]:
        self._close()
        return self.shards


def _split_docs(src: np.ndarray, val_fraction: float, seed: int) -> Dict[str, np.ndarray]:
    """Deterministic document-level split, source by source: the first ``round(n_i * f)`` documents of a seeded
    permutation of source ``i``'s ``n_i`` documents are val (source 0's permutation is seeded by ``seed`` alone,
    source ``i``'s by ``(seed, i)``). A source's split depends only on its own documents and its place in the
    list, so a mix that appends sources to another (the KD mix of the ILD mix plus teacher samples) puts every
    shared document in the same split: the other mix's validation text never becomes training text. At least
    one document is val and one is train."""
    n_docs = src.size
    if n_docs < 2:
        raise ConfigError(f"sources: found {n_docs} document(s), need at least 2 (one for train, one for "
                          f"validation); add text or use txt_split='paragraphs' for a single .txt file")
    val = []
    for i in np.unique(src):
        docs = np.flatnonzero(src == i)
        rng = np.random.default_rng(seed if i == 0 else [seed, int(i)])
        val.append(docs[rng.permutation(docs.size)[:int(round(docs.size * val_fraction))]])
    val_idx = np.sort(np.concatenate(val))
    if val_idx.size == 0:  # every source too small for its share: one document of the largest
        largest = np.flatnonzero(src == np.bincount(src).argmax())
        val_idx = largest[np.random.default_rng(seed).permutation(largest.size)[:1]]
    if val_idx.size == n_docs:
        val_idx = val_idx[1:]
    train = np.setdiff1d(np.arange(n_docs), val_idx)
    return {"train": train, "val": val_idx}


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` is replaced only with ``overwrite``."""
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif not overwrite:
            raise ConfigError(f"out_dir {out}: already exists; pass overwrite (--overwrite) to replace it")
        else:
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.rename(tmp, out)


def prepare(sources: Sequence[Any], tokenizer: str, out_dir, *, val_fraction: float = 0.05, num_proc: int = 1,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, text_field: str = "text", txt_split: str = "file",
            seed: int = 1234, overwrite: bool = False, progress: bool = True, where: str = "prepare") -> Dict[str, Any]:
    """Tokenize ``sources`` into packed shards under ``out_dir``; returns the written ``meta.json`` dict."""
    import datasets

    cfg = DataConfig(path=str(out_dir), sources=list(sources), tokenizer=tokenizer, val_fraction=val_fraction,
                     num_proc=num_proc, shard_tokens=shard_tokens, text_field=text_field, txt_split=txt_split,
                     seed=seed)
    cfg.validate(where)
    if not cfg.sources:
        raise ConfigError(f"{where}.sources: expected at least one file, directory or dataset name")
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ConfigError(f"out_dir {out}: already exists; pass overwrite (--overwrite) to replace it")
    tok = assets.load_tokenizer(tokenizer)
    tok_file = assets.resolve_tokenizer_file(tokenizer)
    vocab_size, eos_id = len(tok), tok.eos_token_id
    dtype = token_dtype(vocab_size)
    entries = source_entries(cfg.sources, f"{where}.sources")
    weights = [source_weight(e) for e in cfg.sources]
    sources: List[Any] = [_entry(assets.resolve_source(s), cap, w) for (s, cap), w in zip(entries, weights)]
    for s, _ in source_entries(sources):  # fail on a missing file before any slow work
        _source_files(s)
    if num_proc > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked workers; avoid the fork warning
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temporaries(out)
    global _PREPARING_PID
    _PREPARING_PID = os.getpid()
    # the temporary dir names its process, so that a later prepare can tell an abandoned one from a live one
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    children_die_with_it = _children_die_with_this_process()
    children_die_with_it.__enter__()
    try:
        work = tmp / "_work"  # datasets' arrow cache for this run only; deleted before the rename
        was_enabled = datasets.is_progress_bar_enabled()
        if not progress:
            datasets.disable_progress_bars()
        try:
            try:
                docs = datasets.Dataset.from_generator(
                    _gen_documents,
                    gen_kwargs={"sources_json": json.dumps(sources), "text_field": text_field, "txt_split": txt_split,
                                "tokenizer_file": str(tok_file), "seed": seed},
                    cache_dir=str(work), fingerprint=uuid.uuid4().hex)
            except datasets.exceptions.DatasetGenerationError as e:
                if isinstance(e.__cause__, ConfigError):  # our own message, wrapped by datasets
                    raise e.__cause__ from None
                if type(e.__cause__).__name__ == "SchemaInferenceError":  # the generator yielded nothing
                    raise ConfigError(f"{where}.sources: no text in {_normalized_sources(sources)} (every file is "
                                      f"empty or whitespace only); give sources that hold text") from None
                raise
            src = np.asarray(docs["src"], dtype=np.int64)
            split_idx = _split_docs(src, val_fraction, seed)
            if any(w != 1.0 for w in weights):
                split_idx["train"] = _weighted(split_idx["train"], src, weights, seed)
            ids = docs.map(_tokenize_batch, batched=True, batch_size=64, num_proc=min(num_proc, len(docs)),
                           remove_columns=["text"], new_fingerprint=uuid.uuid4().hex, desc="tokenize",
                           fn_kwargs={"tokenizer_file": str(tok_file), "eos_id": eos_id, "dtype": dtype})
        finally:
            if was_enabled and not progress:
                datasets.enable_progress_bars()
        per_source = _per_source_counts(ids, len(sources))
        meta_splits: Dict[str, Any] = {}
        bar = tqdm(total=len(docs), desc="write shards", unit="doc", disable=not progress)
        for split in SPLITS:
            writer = _ShardWriter(tmp, split, dtype, shard_tokens)
            n_tokens = 0
            for table in ids.select(split_idx[split]).with_format("arrow").iter(batch_size=256):
                flat = table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
                writer.write(flat)
                n_tokens += flat.size
                bar.update(table.num_rows)
            meta_splits[split] = {"num_docs": int(split_idx[split].size), "num_tokens": int(n_tokens),
                                  "shards": writer.finish()}
        bar.close()
        del ids, docs  # release the arrow files before deleting them
        shutil.rmtree(work, ignore_errors=True)
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "byteorder": "little",
            "tokenizer": {"path": str(tok_file), "vocab_size": vocab_size, "eos_id": eos_id,
                          "bos_id": tok.bos_token_id},
            "documents": "each document's tokens (no BOS) followed by eos_id; split train/val by document",
            "params": {"sources": _normalized_sources(sources),
                       "text_field": text_field, "txt_split": txt_split, "val_fraction": float(val_fraction),
                       "split": SPLIT_RULE,
                       "seed": seed, "shard_tokens": shard_tokens},
            "splits": meta_splits,
            "sources": [dict(source=s, **c) for s, c in zip(_normalized_sources(sources), per_source)],
            "seconds": round(time.perf_counter() - t0, 2),
        }
        meta["digest"] = meta_digest(meta)
        write_json(tmp / META, meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the dataset is an ordinary directory
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        children_die_with_it.__exit__(None, None, None)
    meta["path"] = str(out)
    return meta


def _entry(source: str, cap: Optional[int], weight: float) -> Any:
    """A source as ``prepare`` passes it on and records it: the name alone, or with its cap and weight."""
    if cap is None and weight == 1.0:
        return source
    return {"source": source, **({"max_tokens": cap} if cap is not None else {}),
            **({"weight": weight} if weight != 1.0 else {})}


def _weighted(train: np.ndarray, src: np.ndarray, weights: Sequence[float], seed: int) -> np.ndarray:
    """The training documents with each repeated by its source's weight: ``floor(w)`` times, and once more with
    probability ``w - floor(w)`` (a seeded draw per document); a document's copies stay together, and the
    windows a run reads are shuffled anyway."""
    w = np.asarray(weights, dtype=np.float64)[src[train]]
    whole = np.floor(w)
    extra = np.random.default_rng([seed, 1]).random(train.size) < (w - whole)
    return np.repeat(train, (whole + extra).astype(np.int64))


def _per_source_counts(ids, n_sources: int) -> List[Dict[str, int]]:
    """Documents and tokens (EOS included) that each source contributed."""
    import pyarrow.compute as pc

    docs, tokens = np.zeros(n_sources, np.int64), np.zeros(n_sources, np.int64)
    for table in ids.with_format("arrow").iter(batch_size=4096):
        src = table.column("src").to_numpy()
        np.add.at(docs, src, 1)
        np.add.at(tokens, src, pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False))
    return [{"num_docs": int(d), "num_tokens": int(t)} for d, t in zip(docs, tokens)]


def _normalized_sources(sources: Sequence[Any]) -> List[Any]:
    """Sources as recorded in meta.json: absolute paths for local ones, names for datasets; a capped entry
    as ``{"source": ..., "max_tokens": N}``."""
    out: List[Any] = []
    for entry, (s, cap) in zip(sources, source_entries(sources)):
        s = assets.resolve_source(s)
        p = Path(s).expanduser()
        out.append(_entry(str(p.resolve()) if p.exists() else s, cap, source_weight(entry)))
    return out


def ensure_prepared(cfg: DataConfig, where: str = "data", progress: bool = True) -> Path:
    """The prepared dir of ``cfg``: reused when ``cfg.path/meta.json`` exists, else built from ``cfg.sources``.

    Call it on one rank only (others wait at a barrier): preparing is not a collective.
    """
    cfg.validate(where)
    out = Path(cfg.path).expanduser()
    meta_file = out / META
    if meta_file.is_file():
        if cfg.sources:  # refuse to silently train on data prepared from something else
            try:
                params = json.loads(meta_file.read_text(encoding="utf-8")).get("params", {})
            except (OSError, ValueError, AttributeError):
                params = {}  # a corrupt meta.json is reported by PackedTokens with its own message
            recorded, wanted = params.get("sources"), _normalized_sources(cfg.sources)
            if recorded is not None and recorded != wanted:
                raise ConfigError(f"{where}.sources: {out} was prepared from {recorded}, not {wanted}; "
                                  f"delete it or set {where}.path to another directory")
        return out
    if not cfg.sources:
        raise ConfigError(f"{where}.path: {meta_file} does not exist and {where}.sources is empty "
                          f"(expected a directory written by `python -m pretrain.prepare`)")
    prepare(cfg.sources, cfg.tokenizer, out, val_fraction=cfg.val_fraction, num_proc=cfg.num_proc,
            shard_tokens=cfg.shard_tokens, text_field=cfg.text_field, txt_split=cfg.txt_split, seed=cfg.seed,
            progress=progress, where=where)
    return out
