"""Teacher-sampled data: the teacher's own continuations of prompts, written once as a text source for KD / ILD.

Without a web corpus, the teacher itself is the widest source of text in its own distribution. ``sample`` draws
``prompt_len``-token prompts from the training split of a prepared dataset (each at a document's start, within
one document), lets the teacher continue them with temperature / top-p sampling for up to ``gen_len`` tokens,
and writes prompt + continuation as one document per line of ``shard_NNNNN.jsonl`` (``{"text": ...}``), a
directory any ``data.sources`` entry can name, mixed with a corpus mix by ``weight``.

Each shard is one generation batch. Batch ``b`` takes its prompts and its random draws from ``(seed, b)`` alone,
so a run cut at any instant resumes at its first unfinished shard and writes the same bytes as an uninterrupted
run, and a rerun with a larger ``tokens`` only adds shards. A shard is finished when its record
``.shard_NNNNN.json`` (rows, tokens, seconds, the shard's sha256) exists and the shard's content matches it;
both are written atomically, shard first. ``.samples.json`` (hidden, so that ``prepare`` reads only the shards)
holds what the samples were made from: the teacher's weights by sha256, the prompts' dataset, the settings and
its seed; a rerun against another teacher or other settings is refused with one line. Ranks share the shards
round-robin; rank 0 writes the summary (``complete``, tokens, minutes, tokens/s) when every shard is there.

CLI: ``upcycle sample --teacher asset:smollm2 --prompts data_cache/mix-smollm2 --out data_cache/samples --tokens 2e6``;
the route runs it as its ``sample:`` section, before KD (docs/upcycling.md, "Teacher-sampled data").
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, build_dataclass, setting
from hybridlm.data.packed import PackedTokens, read_meta
from hybridlm.engine import barrier, init_distributed
from hybridlm.teacher import load_teacher, load_teacher_tokenizer, resolve_teacher
from hybridlm.training.shell import RunShell
from hybridlm.utils.atomic import atomic_write_text, json_text, write_json
from hybridlm.utils.digest import sha256_of

MANIFEST = ".samples.json"
CACHES = ("static", "dynamic")
DTYPES = ("auto", "bfloat16", "float32")
# settings whose change makes earlier shards another dataset (tokens may grow: it only adds shards)
IDENTITY = ("prompt_len", "gen_len", "temperature", "top_p", "top_k", "batch_size", "seed")


@dataclasses.dataclass
class SampleConfig(Section):
    """The ``sample:`` section of a route, or ``upcycle sample``'s flags."""

    prompts: str = setting("", nonempty="a prepared dataset directory (meta.json) to draw prompts from")
    out: str = setting("", nonempty="the directory the samples are written into")
    tokens: int = setting(1_000_000, ge=1)  # generated tokens wanted (prompts not counted); whole batches
    prompt_len: int = setting(64, ge=1)
    gen_len: int = setting(960, ge=1)  # new tokens per continuation at most (EOS ends one earlier)
    temperature: float = setting(1.0, gt=0)
    top_p: float = setting(1.0, gt=0, le=1)
    top_k: int = setting(0, ge=0)  # 0: no top-k filter
    batch_size: int = setting(256, ge=1)  # continuations per generation batch = per shard
    seed: int = setting(0, ge=0, lt=2**63)
    # dynamic: transformers' plain cache; static: its static cache, which it compiles on a GPU. On one H100 at 512 x
    # 512 both decode at the same rate and the static cache's first batch is slower (BENCHMARKS.md, "Upcycling speed")
    cache: str = setting("dynamic", choices=CACHES)
    dtype: str = setting("auto", choices=DTYPES)  # auto: bfloat16 on a GPU, float32 on the CPU

    def num_shards(self) -> int:
        return math.ceil(self.tokens / (self.batch_size * self.gen_len))

    def identity(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in IDENTITY}


# ------------------------------------------------------------------------------------------ prompts
def prompt_starts(tokens: np.ndarray, eos_id: int, prompt_len: int) -> np.ndarray:
    """Positions where a document starts and its first ``prompt_len`` tokens hold no EOS (the document is
    longer than the prompt)."""
    is_eos = tokens == eos_id
    starts = np.concatenate([[0], np.flatnonzero(is_eos[:-1]) + 1]) if tokens.size else np.zeros(0, np.int64)
    starts = starts[starts + prompt_len <= tokens.size]
    eos_before = np.concatenate([[0], np.cumsum(is_eos, dtype=np.int64)])
    return starts[eos_before[starts + prompt_len] == eos_before[starts]]


def batch_prompts(tokens: np.ndarray, starts: np.ndarray, cfg: SampleConfig, batch: int) -> torch.Tensor:
    """Batch ``batch``'s prompts, ``[batch_size, prompt_len]``: document starts drawn by ``(seed, batch)``,
    without repeats inside a batch where there are enough."""
    rng = np.random.default_rng([cfg.seed, batch])
    pick = rng.choice(starts.size, size=cfg.batch_size, replace=starts.size < cfg.batch_size)
    rows = [tokens[s: s + cfg.prompt_len] for s in starts[pick]]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# ------------------------------------------------------------------------------------------ records
def shard_name(batch: int) -> str:
    return f"shard_{batch:05d}.jsonl"


def _record_path(out: Path, batch: int) -> Path:
    return out / f".shard_{batch:05d}.json"


def finished_record(out: Path, batch: int) -> Optional[Dict[str, Any]]:
    """The record of a finished shard, or None when the shard is missing, unrecorded or not what was recorded
    (a shard that was being written when a run was cut is redone)."""
    rec_file, shard = _record_path(out, batch), out / shard_name(batch)
    if not rec_file.is_file() or not shard.is_file():
        return None
    try:
        rec = json.loads(rec_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("sha256") == sha256_of(shard) else None


def teacher_identity(teacher: str, known: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The teacher as a samples directory records it: its spec, path, the sha256 over its weight files (a ``.gguf``
    file, or a directory's ``*.safetensors`` / ``*.bin`` in name order: another checkpoint under the same path is
    another teacher) and each file's name, size and modification time (ns). ``known`` (the manifest's ``teacher``
    entry) spares reading gigabytes again when its path and file stamps are these."""
    path = resolve_teacher(teacher)
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin"))
    if not files:
        raise ConfigError(f"teacher {teacher!r}: no weight files in {path}")
    stamps = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    known = known if isinstance(known, dict) else {}
    if known.get("path") == str(path) and known.get("files") == stamps and known.get("sha256"):
        digest = str(known["sha256"])
    else:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}:{sha256_of(f)}\n".encode())
        digest = h.hexdigest()
    return {"spec": str(teacher), "path": str(path), "sha256": digest, "files": stamps}


def _identity(cfg: SampleConfig, teacher: str, prompts_meta: Dict[str, Any],
              old: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    return {"format": "hybridlm-teacher-samples", "version": 1,
            "teacher": teacher_identity(teacher, known=(old or {}).get("teacher")),
            "prompts": {"path": str(Path(cfg.prompts).expanduser().resolve()), "digest": prompts_meta.get("digest"),
                        "split": "train"},
            "settings": cfg.identity()}


def _read_manifest(out: Path) -> Optional[Dict[str, Any]]:
    """``out``'s manifest, None when there is none yet; one line when it is not readable JSON."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError(f"{manifest}: not readable JSON; delete {out} or choose another sample.out") from None


def _check_or_write_identity(out: Path, ident: Dict[str, Any], old: Optional[Dict[str, Any]], rank: int) -> None:
    """The directory's identity (``old``: its manifest), written on first use; another teacher, prompt set or
    setting is refused."""
    if old is not None:
        if old.get("teacher", {}).get("sha256") != ident["teacher"]["sha256"]:
            raise ConfigError(f"sample.out: {out} holds samples of teacher {old.get('teacher', {}).get('path')} "
                              f"(sha256 {str(old.get('teacher', {}).get('sha256'))[:12]}), not of "
                              f"{ident['teacher']['path']} (sha256 {ident['teacher']['sha256'][:12]}); "
                              f"choose another sample.out or delete it")
        if old.get("prompts", {}).get("digest") != ident["prompts"]["digest"]:
            raise ConfigError(f"sample.prompts: {out} was sampled from prompts of {old.get('prompts', {}).get('path')}"
                              f", another dataset than {ident['prompts']['path']}; choose another sample.out")
        for key, value in ident["settings"].items():
            if old.get("settings", {}).get(key) != value:
                raise ConfigError(f"sample.{key}: {out} was sampled with {key}={old.get('settings', {}).get(key)!r}, "
                                  f"not {value!r}; keep it or choose another sample.out")
        return
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / MANIFEST, {**ident, "complete": False})


# ------------------------------------------------------------------------------------------ sampling
def _generate(model, prompts: torch.Tensor, cfg: SampleConfig, eos_id: int, pad_id: int, batch: int) -> torch.Tensor:
    """The new tokens of one batch, ``[batch_size, <= gen_len]`` (``pad_id`` after a row's EOS)."""
    device = next(model.parameters()).device
    torch.manual_seed(hash_seed(cfg.seed, batch))
    ids = prompts.to(device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=cfg.temperature,
                             top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.gen_len, eos_token_id=eos_id,
                             pad_token_id=pad_id, cache_implementation=cfg.cache if cfg.cache == "static" else None)
    return out[:, ids.shape[1]:].cpu()


def hash_seed(seed: int, batch: int) -> int:
    """The torch seed of batch ``batch``: from ``(seed, batch)`` alone (63 bits)."""
    return int(np.random.default_rng([seed, batch, 7]).integers(0, 2**63 - 1))


def _rows(prompts: torch.Tensor, new: torch.Tensor, eos_id: int, tokenizer) -> List[Dict[str, Any]]:
    rows = []
    for p, n in zip(prompts.tolist(), new.tolist()):
        end = n.index(eos_id) if eos_id in n else len(n)
        rows.append({"text": tokenizer.decode(p + n[:end], skip_special_tokens=True),
                     "prompt_tokens": len(p), "new_tokens": end, "eos": end < len(n)})
    return rows


def sample(cfg: SampleConfig, teacher: str, progress: bool = True) -> Dict[str, Any]:
    """Write the samples of ``cfg`` (resuming what is there) and return the summary ``.samples.json`` holds."""
    cfg.validate("sample")
    out = Path(cfg.out).expanduser()
    prompts_dir = Path(cfg.prompts).expanduser()
    if not (prompts_dir / "meta.json").is_file():
        raise ConfigError(f"sample.prompts: {prompts_dir / 'meta.json'} does not exist (expected a dataset prepared "
                          f"by `python -m pretrain.prepare` or a route's ild.data)")
    meta = read_meta(prompts_dir)
    dist = init_distributed()
    manifest = _read_manifest(out)
    ident = _identity(cfg, teacher, meta, manifest)
    _check_or_write_identity(out, ident, manifest, dist.rank)
    barrier()
    tokenizer = load_teacher_tokenizer(teacher)
    eos_id = int(meta["tokenizer"]["eos_id"])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id != eos_id:
        raise ConfigError(f"sample.prompts: {prompts_dir} was tokenized with eos id {eos_id}, the teacher's tokenizer "
                          f"has {tokenizer.eos_token_id}; prepare the prompts with the teacher's tokenizer")
    # each finished shard's content is read once: here, or in summarize for the shards written since
    finished = {b: finished_record(out, b) for b in range(cfg.num_shards())}
    todo = [b for b, rec in finished.items() if b % dist.world_size == dist.rank and rec is None]
    if todo:
        _sample_shards(cfg, teacher, prompts_dir, out, todo, eos_id, tokenizer, dist, progress)
    barrier()
    return summarize(cfg, out, ident, write=dist.rank == 0, finished=finished)


def _sample_shards(cfg, teacher, prompts_dir, out, todo, eos_id, tokenizer, dist, progress) -> None:
    tokens = PackedTokens(prompts_dir, "train")[:]
    starts = prompt_starts(tokens, eos_id, cfg.prompt_len)
    if starts.size == 0:
        raise ConfigError(f"sample.prompt_len: no document of {prompts_dir} (train) is longer than {cfg.prompt_len} "
                          f"tokens; lower prompt_len")
    dtype = {"auto": torch.bfloat16 if dist.device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]
    model = load_teacher(teacher, dtype=dtype).to(dist.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    bar = tqdm(total=len(todo) * cfg.batch_size * cfg.gen_len, unit="tok", unit_scale=True, desc="teacher samples",
               disable=not progress or dist.rank != 0, dynamic_ncols=True)
    for batch in todo:
        t0 = time.perf_counter()
        prompts = batch_prompts(tokens, starts, cfg, batch)
        rows = _rows(prompts, _generate(model, prompts, cfg, eos_id, pad_id, batch), eos_id, tokenizer)
        text = "".join(json_text(r) + "\n" for r in rows)
        atomic_write_text(out / shard_name(batch), text)
        seconds = time.perf_counter() - t0
        new = sum(r["new_tokens"] for r in rows)
        write_json(_record_path(out, batch), {"shard": shard_name(batch), "rows": len(rows), "new_tokens": new,
                                              "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                                              "seconds": round(seconds, 3), "device": device_name(dist.device),
                                              "sha256": sha256_of(out / shard_name(batch))})
        bar.update(cfg.batch_size * cfg.gen_len)
        bar.set_postfix_str(f"{new / seconds:,.0f} new tok/s", refresh=False)
        RunShell.check(f"after {shard_name(batch)} (the finished shards are kept; rerun to go on)")
    bar.close()


def summarize(cfg: SampleConfig, out: Path, ident: Dict[str, Any], write: bool,
              finished: Optional[Dict[int, Optional[Dict[str, Any]]]] = None) -> Dict[str, Any]:
    """The summary of a finished sample directory: tokens, rows, generation seconds and speed. ``finished``: the
    records already verified by this process (the others are read and checked here)."""
    finished = finished or {}
    records = [finished.get(b) or finished_record(out, b) for b in range(cfg.num_shards())]
    missing = [shard_name(b) for b, r in enumerate(records) if r is None]
    if missing:
        raise ConfigError(f"sample.out: {out} lacks {len(missing)} finished shard(s) ({missing[0]} ...); run the "
                          f"same command again to finish them")
    new = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    summary = {**ident, "complete": True, "shards": len(records), "rows": sum(r["rows"] for r in records),
               "new_tokens": new, "prompt_tokens": sum(r["prompt_tokens"] for r in records),
               "generation_minutes": round(seconds / 60, 2),
               "new_tokens_per_second": round(new / seconds, 1) if seconds else None, "tokens_wanted": cfg.tokens,
               "devices": sorted({r.get("device", "?") for r in records})}
    if write:
        write_json(out / MANIFEST, summary)
        print(f"teacher samples: {summary['rows']} continuations, {new:,} new tokens in "
              f"{summary['generation_minutes']} min of generation ({summary['new_tokens_per_second']:,} tokens/s) "
              f"-> {out}", flush=True)
    return summary


def run_sample(cfg: SampleConfig, teacher: str) -> Dict[str, Any]:
    """``upcycle sample``: :func:`sample` inside the run shell of ``cfg.out`` (its lock, pre-emption signals)."""
    with RunShell(Path(cfg.out).expanduser(), what="sample.out"):
        return sample(cfg, teacher)


def add_subcommand(subparsers) -> None:
    """``upcycle sample``: one flag per :class:`SampleConfig` field (``--gen-len`` for ``gen_len``)."""
    p = subparsers.add_parser("sample", help="the teacher's sampled continuations of prompts from a prepared "
                              "dataset, written once as a text source for KD / ILD (resumable)")
    p.add_argument("--teacher", required=True, help="Llama directory, .gguf file, or asset:smollm2")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    defaults = SampleConfig(prompts="-", out="-")
    for f in dataclasses.fields(SampleConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": _count, "float": float}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
        if f.name in ("prompts", "out"):
            p.add_argument(flag, required=True, help=SAMPLE_HELP[f.name])
        else:
            p.add_argument(flag, type=kind, default=getattr(defaults, f.name),
                           choices=f.metadata.get("choices"), help=SAMPLE_HELP.get(f.name, "") + " (default: %(default)s)")
    p.set_defaults(fn=lambda args: run_sample(
        build_dataclass(SampleConfig, {f.name: getattr(args, f.name) for f in dataclasses.fields(SampleConfig)},
                        "sample"), args.teacher))


def _count(text: str) -> int:
    """An integer flag that also takes 2e6 / 2_000_000."""
    value = float(text.replace("_", ""))
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


SAMPLE_HELP = {
    "prompts": "a prepared dataset (meta.json; prepared with the teacher's tokenizer): prompts start at its "
               "training documents' starts",
    "out": "the directory of shard_NNNNN.jsonl files (a data source); rerun to resume",
    "tokens": "generated tokens wanted, prompts not counted (rounded up to whole batches)",
    "prompt_len": "prompt tokens", "gen_len": "new tokens per continuation at most",
    "temperature": "sampling temperature", "top_p": "nucleus sampling mass", "top_k": "top-k filter (0: none)",
    "batch_size": "continuations per generation batch (one shard each)", "seed": "prompts and draws",
    "cache": "dynamic: transformers' plain cache; static: its static cache, compiled on a GPU (no faster at "
             "large batches, slower to start)",
    "dtype": "auto: bfloat16 on a GPU, float32 on the CPU",
}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
