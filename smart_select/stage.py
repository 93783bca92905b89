"""SMART: measure how much each layer helps as MLA, pick the MLA layers, report (README, "Upcycling a Llama").

Starting from the two ILD students (pure MLA and pure Mamba2), on a calibration set of packed token
windows (teacher tokenizer):

* ``KL_all`` = KL(teacher || all-Mamba2 student);
* ``KL_i``   = KL(teacher || the Mamba2 student with decoder layer ``i`` taken from the MLA student);
* ``s_i = KL_all - KL_i``; :func:`smart_select.selection.select_layers` picks the MLA layers; the report goes
  through :func:`smart_select.report.write_smart_report` with the KV-cache accounting of the chosen layers.

KL is the token mean over every calibration position of ``sum_v p_t(v) (log p_t(v) - log p_s(v))`` from
fp32 ``log_softmax`` of both models' logits (nats/token), computed by the KD loss's chunked loop
(:func:`distill.kd_loss.kl_sum`): the teacher contributes its final hidden states, and logits exist one chunk at a
time.

Swapping "layer i" moves the *whole* decoder layer (mixer sublayer ``2i`` and MLP sublayer ``2i + 1``,
each with its pre-norm) of the MLA student into the Mamba2 student, exactly as
:func:`upcycle.compose.compose_hybrid` builds ``[i]`` (the MLP of layer i co-trained with its mixer in
ILD). The swap is done in place on the Mamba2 student's module list and undone afterwards; the hidden
state entering layer ``i`` is shared by the all-Mamba2 model and swap ``i`` (layers before ``i`` are
identical), so per batch the teacher runs once and the students run ``L (L + 1) / 2 + L`` decoder
layers instead of ``L (L + 1)``.

The stage's options are :class:`SmartConfig` (the route's ``smart:`` section, and the flags of ``upcycle smart``).
CLI (wired into ``upcycle`` by :func:`add_subcommand`; ``upcycle compose --from-smart`` then builds the hybrid)::

    upcycle smart --teacher asset:smollm2 --mla-student runs/smollm2/ild_mla/final \\
        --linear-student runs/smollm2/ild_mamba2/final --data-path data_cache/alpaca-smollm2 \\
        --seq-len 256 --batches 8 --n-mla 8 --out runs/smollm2/smart
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from distill.kd_loss import final_hidden, kl_sum
from hybridlm.config.errors import ConfigError
from hybridlm.config.layers import parse_layers
from hybridlm.config.structured import setting
from hybridlm.data import DataConfig, PackedTokens, ensure_prepared, load_tokenizer, read_meta, validation_batches
from hybridlm.engine import all_reduce_sum, barrier, init_distributed
from hybridlm.kv_report import kv_report
from hybridlm.students import check_layers, check_shared_weights, check_students, load_student, load_student_config
from hybridlm.teacher import check_tokenizer_matches, load_teacher, load_teacher_tokenizer, resolve_teacher
from hybridlm.utils.atomic import write_json
from hybridlm.utils.flags import RenamedFlag
from smart_select.report import write_smart_report
from smart_select.selection import METHODS, restore_layers, select_layers, sensitivities

PathLike = Union[str, os.PathLike]
KL_CHUNK_TOKENS = 1024  # tokens per chunk of both models' logits (distill.kd_loss.kl_sum)
RUN_INFO = "smart_run.json"
SPLITS = ("val", "train")


# ---------------------------------------------------------------------------------------------- KL
def _ids(batch) -> torch.Tensor:
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ConfigError(f"batches: expected [batch, seq] input_ids tensors, got {type(ids).__name__}")
    return ids


def _rows(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.reshape(-1, hidden.shape[-1])


@torch.no_grad()
def teacher_hidden(teacher, input_ids: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the teacher's final hidden states as ``[tokens, d]`` rows, its LM-head weight) on ``device``: what the
    chunked KL needs, a vocabulary-size factor less than the teacher's log-probabilities."""
    dev = next(teacher.parameters()).device
    rows = _rows(final_hidden(teacher, input_ids.to(dev)))
    return rows.to(device), teacher.get_output_embeddings().weight.to(device)


@torch.no_grad()
def kl_sum_from_hidden(teacher_rows: Tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, student) -> float:
    """Summed KL over tokens given the student's last hidden state *before* its final norm."""
    ht, wt = teacher_rows
    return kl_sum(_rows(student.model.norm(hidden)), student.get_output_embeddings().weight, ht, wt,
                  KL_CHUNK_TOKENS)


@torch.no_grad()
def model_kl(teacher, student, batches: Iterable) -> float:
    """KL(teacher || student) in nats/token over ``batches`` through the student's ordinary forward."""
    total, n = 0.0, 0
    dev = next(student.parameters()).device
    for batch in batches:
        ids = _ids(batch)
        ht, wt = teacher_hidden(teacher, ids, dev)
        total += kl_sum(_rows(final_hidden(student, ids.to(dev))), student.get_output_embeddings().weight, ht, wt,
                        KL_CHUNK_TOKENS)
        n += ids.numel()
    if n == 0:
        raise ConfigError("batches: no calibration tokens")
    return total / n


# -------------------------------------------------------------------------------------- sensitivity
@contextlib.contextmanager
def swapped_layer(mamba_student, mla_student, i: int):
    """Temporarily put decoder layer ``i`` (sublayers ``2i``, ``2i + 1``) of the MLA student into the
    Mamba2 student's module list; restored on exit (also on error). Neither model is copied."""
    lin, mla = mamba_student.model.layers, mla_student.model.layers
    saved = (lin[2 * i], lin[2 * i + 1])
    lin[2 * i], lin[2 * i + 1] = mla[2 * i], mla[2 * i + 1]
    try:
        yield mamba_student
    finally:
        lin[2 * i], lin[2 * i + 1] = saved


def _check_pair(mla_student, mamba_student) -> int:
    L, _ = check_students(mla_student.config, mamba_student.config)
    check_shared_weights(mla_student, mamba_student)
    pa, pb = next(mla_student.parameters()), next(mamba_student.parameters())
    if pa.dtype != pb.dtype or pa.device != pb.device:
        raise ConfigError(f"students: the MLA student is {pa.dtype} on {pa.device}, the mamba student "
                          f"{pb.dtype} on {pb.device}; put both on one device and dtype")
    return L


@torch.no_grad()
def layer_sensitivities(teacher, mla_student, mamba_student, batches: Iterable,
                        log: Optional[Callable[[str], None]] = None,
                        shard: Tuple[int, int] = (0, 1)) -> Tuple[float, List[float]]:
    """``(KL_all, [KL_i for every layer i])`` in nats/token over the calibration ``batches``.

    ``KL_all`` is KL(teacher || mamba_student); ``KL_i`` the same with decoder layer ``i`` swapped in from
    ``mla_student`` (equal to the KL of ``compose_hybrid(mla_student, mamba_student, [i])``). The teacher
    runs once per batch; the prefix up to layer ``i`` is shared. ``batches``: dicts with ``input_ids`` or
    ``[batch, seq]`` LongTensors. ``log`` gets one progress line per batch. ``shard = (rank, world_size)``:
    this rank measures batches ``rank, rank + world_size, ...`` and the sums are added over the ranks (batches,
    not layers, are split: every layer's KL shares the batch's all-Mamba2 prefix)."""
    L = _check_pair(mla_student, mamba_student)
    if teacher.config.vocab_size != mamba_student.config.vocab_size:
        raise ConfigError(f"teacher: vocabulary {teacher.config.vocab_size} vs the students' "
                          f"{mamba_student.config.vocab_size}")
    dev = next(mamba_student.parameters()).device
    blocks = mamba_student.model.layers
    kl_all, kl_i, n_tok, n_batch = 0.0, [0.0] * L, 0, 0
    t0 = time.perf_counter()
    rank, world_size = shard
    for b, batch in enumerate(batches):
        if b % world_size != rank:
            continue
        ids = _ids(batch)
        t_rows = teacher_hidden(teacher, ids, dev)
        h = mamba_student.model.embed_tokens(ids.to(dev))  # = the MLA student's (checked equal)
        for i in range(L):
            with swapped_layer(mamba_student, mla_student, i):
                x = h
                for block in blocks[2 * i:]:
                    x = block(x)
            kl_i[i] += kl_sum_from_hidden(t_rows, x, mamba_student)
            h = blocks[2 * i + 1](blocks[2 * i](h))  # advance the all-Mamba2 prefix by layer i
        kl_all += kl_sum_from_hidden(t_rows, h, mamba_student)
        n_tok += ids.numel()
        n_batch += 1
        if log is not None:
            dt = time.perf_counter() - t0
            log(f"smart: batch {n_batch}: {n_tok} tokens, {dt:.1f}s ({n_tok / max(dt, 1e-9):.0f} tok/s), "
                f"KL_all so far {kl_all / n_tok:.4f}")
    if world_size > 1:
        kl_all, *kl_i, n_tok = all_reduce_sum([kl_all, *kl_i, n_tok])
    if n_tok == 0:
        raise ConfigError("batches: no calibration tokens")
    return kl_all / n_tok, [k / n_tok for k in kl_i]


# ---------------------------------------------------------------------------------------- the stage
@dataclass
class SmartConfig:
    """The ``smart:`` section of a route and the options of ``upcycle smart``: how many MLA layers (``n_mla``, chosen
    by sensitivity) or which (``mla_layers``, an explicit list, still measured and reported), exactly one of the two;
    how ``n_mla`` layers are chosen (``method``: ``smart``, spaced, or ``kl_restore``, the largest KL drops); and the
    calibration data, ``batches`` batches of ``batch_size`` windows of the packed data's ``split``."""

    n_mla: Optional[int] = None
    mla_layers: Optional[List[int]] = None
    # smart: SMART's spaced choice (smart_select/selection.py); kl_restore: the n_mla largest KL drops, clustered
    # or not (fla-org/hybrid-distillation)
    method: str = setting("smart", choices=tuple(METHODS))
    batches: int = 8
    batch_size: int = 4
    split: str = setting("val", choices=SPLITS)


def _check_selection(cfg: SmartConfig, L: int) -> Tuple[int, Optional[List[int]]]:
    """(the number of MLA layers, the explicit list or None) for students of ``L`` layers."""
    if (cfg.n_mla is None) == (cfg.mla_layers is None):
        raise ConfigError("smart: give exactly one of n_mla (--n-mla: choose by sensitivity) or mla_layers "
                          "(--mla-layers: an explicit list)")
    if cfg.mla_layers is not None:
        mla_layers = check_layers(cfg.mla_layers, L)
        return len(mla_layers), mla_layers
    n_mla = cfg.n_mla
    if isinstance(n_mla, bool) or not isinstance(n_mla, int) or not 0 <= n_mla <= L:
        raise ConfigError(f"--n-mla: expected an integer between 0 and the {L} layers, got {n_mla!r}")
    return n_mla, None


def calibration_batches(data_cfg, teacher_tokenizer, teacher_path: Optional[PathLike], n_batches: int,
                        batch_size: int, split: str = "val") -> List[Dict[str, torch.Tensor]]:
    """The leading ``n_batches`` windows of ``split`` of the packed data (prepared with the teacher's
    tokenizer if missing; ConfigError if it was prepared with another tokenizer)."""

    if split not in SPLITS:
        raise ConfigError(f"--split: expected train or val, got {split!r}")
    for name, v in (("--batches", n_batches), ("--batch-size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}: expected an integer >= 1, got {v!r}")
    if data_cfg.tokenizer == "teacher":
        if teacher_path is None:
            raise ConfigError("data.tokenizer: 'teacher' needs the teacher's path")
        data_cfg.tokenizer = str(resolve_teacher(teacher_path))
    path = ensure_prepared(data_cfg, progress=False)
    check_tokenizer_matches(teacher_tokenizer, load_tokenizer(read_meta(path)["tokenizer"]["path"]))
    return validation_batches(PackedTokens(path, split), data_cfg.seq_len, batch_size, n_batches)


def run_smart(cfg: SmartConfig, teacher, mla_dir: PathLike, mamba_dir: PathLike, data_cfg, out_dir: PathLike, *,
              device: Optional[str] = None, teacher_tokenizer=None, verbose: bool = True,
              dist=None) -> Dict[str, Any]:
    """Sensitivities on the calibration data, the layer choice and the report in ``out_dir``.

    ``cfg``: the stage's options (:class:`SmartConfig`: exactly one of ``n_mla``, the selection rule, or
    ``mla_layers``, explicit, still measured and reported; the calibration batches). ``teacher``: a path /
    ``asset:`` spec, or a loaded ``LlamaForCausalLM`` (its tokenizer then comes from ``teacher_tokenizer`` or its
    ``name_or_path``). ``data_cfg``: a :class:`hybridlm.data.DataConfig` (packed; ``tokenizer: teacher`` means the
    teacher's). The KV report uses the MLA student's ``kv_lora_rank`` and ``qk_rope_head_dim``. Returns a dict with
    ``kl_all``, ``kl``, ``sensitivity``, ``chosen`` (the MLA layers), ``kv``, ``paths``...
    ``dist`` (:class:`hybridlm.engine.DistInfo`): every rank of the job measures its share of the batches on its
    own device (the data is prepared on rank 0 first); rank 0 selects, logs and writes the report.
    """

    t_start = time.perf_counter()
    rank, world_size = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    verbose = verbose and rank == 0
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if verbose else None
    L, linear = check_students(load_student_config(mla_dir, "mla student"),
                               load_student_config(mamba_dir, "mamba student"))
    n_mla, explicit = _check_selection(cfg, L)  # fail before loading any weights
    if isinstance(teacher, (str, os.PathLike)):
        teacher_path, model = teacher, None
    else:
        model = teacher
        teacher_path = getattr(teacher, "name_or_path", None) or None
        if teacher_tokenizer is None and not teacher_path:
            raise ConfigError("teacher: a loaded model needs teacher_tokenizer (it has no name_or_path)")
    tok = teacher_tokenizer or load_teacher_tokenizer(teacher_path)
    batches, batch_size, split = cfg.batches, cfg.batch_size, cfg.split
    if world_size > 1:  # preparing is not collective: rank 0 prepares when the data is missing, the others wait
        if rank == 0:
            calibration_batches(copy.deepcopy(data_cfg), tok, teacher_path, batches, batch_size, split)
        barrier()
    calib = calibration_batches(data_cfg, tok, teacher_path, batches, batch_size, split)  # before any weights
    if say is not None and (len(calib) < batches or calib[0]["input_ids"].shape[0] < batch_size):
        say(f"smart: the {split} split holds only {len(calib)} batch(es) of {calib[0]['input_ids'].shape[0]} "
            f"window(s) of {data_cfg.seq_len} tokens (asked for {batches} x {batch_size}); using those")
    if model is None:
        model = load_teacher(teacher_path, dtype=torch.float32)
    if model.config.num_hidden_layers != L:
        raise ConfigError(f"teacher: {model.config.num_hidden_layers} layers, the students {L}")
    mla = load_student(mla_dir, "mla student")
    mamba = load_student(mamba_dir, "mamba student")
    dev = torch.device(device) if device else (dist.device if dist is not None else
                                               torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev).eval()
    mla.to(dev)
    mamba.to(dev)

    t0 = time.perf_counter()
    kl_all, kl = layer_sensitivities(model, mla, mamba, calib, log=say, shard=(rank, world_size))
    seconds = time.perf_counter() - t0
    sens = sensitivities(kl_all, kl)
    if explicit is None and cfg.method == "kl_restore":
        mla_layers = restore_layers(sens, n_mla)
    else:
        mla_layers = select_layers(sens, n_mla, mla_layers=explicit, num_layers=L)
    selection = "explicit" if explicit is not None else cfg.method
    kv_lora_rank, qk_rope_head_dim = mla.config.mla["kv_lora_rank"], mla.config.mla["qk_rope_head_dim"]
    kv = kv_report(model.config, mla_layers, kv_lora_rank, qk_rope_head_dim)
    if rank != 0:
        return {"kl_all": kl_all, "kl": kl, "sensitivity": sens, "chosen": mla_layers, "kv": kv}
    out = Path(out_dir).expanduser()
    paths = write_smart_report(out, kl_all, kl, mla_layers, kv, method=selection)
    n_tokens = sum(b["input_ids"].numel() for b in calib)
    info = {"teacher": str(teacher_path), "mla_student": str(Path(mla_dir).resolve()),
            "mamba_student": str(Path(mamba_dir).resolve()), "linear_mixer": linear, "num_layers": L,
            "n_mla": n_mla, "selection": selection,
            "data": {"path": str(data_cfg.path), "split": split, "seq_len": data_cfg.seq_len,
                     "batches": len(calib), "batch_size": int(calib[0]["input_ids"].shape[0]), "tokens": n_tokens},
            "kl_unit": "nats/token", "kl_all": kl_all, "kl": kl, "sensitivity": sens, "chosen": mla_layers,
            "kv_ratio": kv["ratio"], "kv_compression": kv["compression"], "kv_lora_rank": kv_lora_rank,
            "qk_rope_head_dim": qk_rope_head_dim, "device": str(dev), "measure_seconds": round(seconds, 2),
            "seconds": round(time.perf_counter() - t_start, 2)}
    write_json(out / RUN_INFO, info)
    if verbose:
        print(paths["md"].read_text(encoding="utf-8"), flush=True)
        print(f"chosen MLA layers: {','.join(map(str, mla_layers))}", flush=True)
        print(f"report: {paths['json']} (+ .md, .png); {n_tokens} tokens in {seconds:.1f}s", flush=True)
    return {**info, "paths": {k: str(v) for k, v in paths.items()}, "kv": kv}


# ---------------------------------------------------------------------------------------------- CLI
def cmd_smart(args) -> Dict[str, Any]:
    for flag, d in (("--mla-student", args.mla_student), ("--linear-student", args.linear_student)):
        if not Path(d).expanduser().is_dir():
            raise ConfigError(f"{flag}: {d} is not a directory")
    mla_layers = parse_layers(args.mla_layers, "--mla-layers") if args.mla_layers is not None else None
    cfg = SmartConfig(n_mla=args.n_mla, mla_layers=mla_layers, method=args.method, batches=args.batches,
                      batch_size=args.batch_size, split=args.split)
    data_cfg = DataConfig(path=args.data_path, seq_len=args.seq_len, sources=list(args.data_source or []),
                          tokenizer="teacher", text_field=args.text_field)
    # under a launcher (torch.distributed.run, deepspeed) every rank measures its share of the batches
    dist = init_distributed() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    return run_smart(cfg, args.teacher, args.mla_student, args.linear_student, data_cfg, args.out, device=args.device,
                     dist=dist)


def add_subcommand(subparsers) -> None:
    """Register ``smart`` on an ``argparse`` subparsers object (``fn`` takes the namespace); the flags that set
    :class:`SmartConfig` default to its fields."""
    s = subparsers.add_parser("smart", help="SMART: per-layer KL sensitivities of the ILD students, MLA layer choice, report")
    s.add_argument("--teacher", required=True, help="Llama directory, .gguf file, or asset:smollm2")
    s.add_argument("--mla-student", required=True, help="the pure-MLA student directory (after ILD)")
    s.add_argument("--linear-student", "--mamba-student", required=True, action=RenamedFlag, old=("--mamba-student",),
                   help="the pure linear-mixer student directory, after ILD (--mamba-student: its old name)")
    s.add_argument("--data-path", required=True, help="packed dataset directory (prepared here if missing)")
    s.add_argument("--data-source", action="append", default=None,
                   help="source file / dataset to prepare --data-path from with the teacher's tokenizer (repeatable)")
    s.add_argument("--text-field", default="text", help="text field of JSON records (alpaca records work as is)")
    s.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    s.add_argument("--batches", type=int, default=SmartConfig.batches, help="number of calibration batches")
    s.add_argument("--batch-size", type=int, default=SmartConfig.batch_size, help="windows per calibration batch")
    s.add_argument("--split", choices=SPLITS, default=SmartConfig.split, help="split the calibration windows come from")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--n-mla", type=int, default=None, help="number of MLA layers to choose by sensitivity")
    g.add_argument("--mla-layers", default=None,
                   help="explicit comma-separated MLA layers (still measured and reported)")
    s.add_argument("--method", choices=tuple(METHODS), default=SmartConfig.method,
                   help="how --n-mla layers are chosen: smart (SMART's spaced choice) or kl_restore (the largest KL "
                        "drops of restoring a layer to attention, clustered or not; fla-org/hybrid-distillation)")
    s.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    s.add_argument("--out", required=True, help="report directory (smart_report.json / .md / .png, smart_run.json)")
    s.set_defaults(fn=cmd_smart)
