"""Training throughput of the real pre-training step, and of peers in a plain PyTorch loop (BENCHMARKS.md, "Training throughput").

    python -m benchmarks.train_speed --out DIR \\
        [--configs gdn_300m kda_300m mamba2_300m gdn_300m_hybrid mamba2_300m_hybrid gdn_1b] \\
        [--peers fla_gdn fla_kda llama] [--micro-batch 32 | --find-max-batch] [--seq 2048] \\
        [--steps 12] [--warmup 3] [--data data_cache/janeausten-llama3.2] [--peak-tflops 989.5] \
        [--profile 3 [--trace]] [--model-override KEY=VALUE ...] [--optim-override KEY=VALUE ...] \
        [--runtime-override KEY=VALUE ...]
    deepspeed --num_gpus 2 -m benchmarks.train_speed --out DIR ...   # ZeRO-1 data parallel

**Ours** is ``pretrain.py``'s job itself: :func:`pretrain.train.prepare_pretraining` (packed shards, the
rank-sharded ``PackedBatches`` loader), :func:`pretrain.train.build_engine` (the model in the DeepSpeed
ZeRO-1 :class:`~hybridlm.engine.Engine`, bf16 weights with fp32 master weights and gradient accumulation,
fused AdamW, clipping) and the shared :func:`~hybridlm.training.train_loop`, timed through its
``on_step`` hook, which the loop calls once the GPU has finished the step, with checkpoints off. A config is a
model YAML name from ``configs/models`` (or any model / experiment YAML path; only its model section is used),
optionally with overrides of its own after colons (``gdn_300m:optim.step_on_device=true:runtime.split_conv_outputs=true``):
variants of one config measured in the same run, next to the same peers.

**Peers** (one-process runs only): fla's ``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM`` with the
shapes of our GDN / KDA config (``fla_gdn[:CONFIG]``, default ``gdn_300m``; ``fla_kda[:CONFIG]``, default
``kda_300m``), and transformers' ``LlamaForCausalLM`` (sdpa) with the hidden size, FFN width, block
count, vocabulary and tying of ``CONFIG`` (``llama[:CONFIG]``, default ``gdn_300m``; heads of 64, a
quarter as many KV heads). They train as a user would write it: fp32 parameters, bf16 autocast,
``torch.optim.AdamW(fused=True)``, clipping at 1.0, on the same batches from the same loader, reading the
loss as each step ends; a ``+late`` suffix (``fla_gdn+late``) reads it after the next step is launched, as
our loop does (its fastest plain loop: the GPU is never left waiting for the host to log).

Per entry: median step time over ``--steps`` steps after ``--warmup`` steps (the first includes Triton
autotuning), tokens/s = global tokens per step / that, MFU by :mod:`benchmarks.harness.flops`, and peak
``torch.cuda.max_memory_allocated`` over the measured steps; ours also list every rank's peak and its ZeRO-1 shard
(``ranks``: the fp32 master weights and AdamW moments it holds). ``--find-max-batch`` tries
``--batch-candidates`` from the largest, each in a fresh model / engine, and measures the largest that
does not run out of memory. Writes ``DIR/train_speed.json`` and ``DIR/train_speed.png`` after every
entry; ``--merge A.json B.json --out DIR`` joins reports of separate runs and redraws the chart. ``--profile N``
adds each entry's kernel time by category over N more steps, and its GEMMs' time by operand shapes with the
TFLOP/s each shape ran at (benchmarks/harness/profile_step.py); ``--trace`` also writes those steps as a Chrome trace
with Python stacks (``DIR/trace_<entry>.json.gz``), whose idle gaps ``python -m benchmarks.harness.trace_gaps`` traces
to the code that ran then.
On a machine without CUDA everything runs in fp32 on the CPU (fla peers are skipped: Triton).
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.harness import flops as F
from benchmarks.harness.common import (DEFAULT_DATA, DEFAULT_SOURCES, DEFAULT_TOKENIZER, free_memory, is_oom,
                                   merge_reports, model_section, versions, write_report)
from benchmarks.harness.peers import PEER_BASE, build_peer
from benchmarks.harness.profile_step import StepProfiler, format_profile
from hybridlm.config.loader import deep_merge, parse_override
from hybridlm.data import DataConfig, PackedBatches, PackedTokens, ensure_prepared, read_meta
from hybridlm.engine import barrier, init_distributed
from hybridlm.engine.config import PRECISIONS
from hybridlm.model.configuration import resolve_model_config
from hybridlm.model.runtime import KERNEL_SOURCES
from hybridlm.model.summary import build_on_meta, model_summary
from hybridlm.ops.causal_conv import offer_pass1_x_once
from hybridlm.training import train_loop
from hybridlm.utils.atomic import save_figure
from hybridlm.utils.readback import Readback
from pretrain.train import build_engine, prepare_pretraining, pretrain_config

DEFAULT_CONFIGS = ["gdn_300m", "kda_300m", "mamba2_300m", "gdn_300m_hybrid", "mamba2_300m_hybrid", "gdn_1b"]
DEFAULT_PEERS = ["fla_gdn", "fla_kda", "llama"]
OOM = "out of memory"
FAILED = "failed"  # an entry that raised under --keep-going
PRECISION_RECIPE = {"bf16": "bf16 weights, fp32 master + grad accumulation",
                    "bf16-mixed": "fp32 weights, bf16 autocast", "fp32": "fp32"}


# --------------------------------------------------------------------------------------- utilities

class StepTimer:
    """``on_step`` hook: wall time at the end of every step, peak memory from the end of the warm-up on; step
    ``i``'s time is the gap to step ``i - 1``'s end (data loading included). ``sync=True`` waits for the device
    first; a caller whose results were read after the step's work finished (a
    :class:`~hybridlm.utils.readback.Readback`, as the training loop reads them) passes ``sync=False``: a sync
    would also wait for the next step, already launched."""

    def __init__(self, warmup: int, device: torch.device, measured: Optional[int] = None, sync: bool = True):
        self.warmup, self.device, self.measured, self.sync_each = warmup, device, measured, sync
        self.ends: List[float] = []
        self.tokens: List[int] = []
        self.losses: List[float] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, result) -> None:
        self.record(result.tokens, result.loss)

    def record(self, tokens: int, loss: float) -> None:
        if self.sync_each:
            self.sync()
        self.ends.append(time.perf_counter())
        self.tokens.append(int(tokens))
        self.losses.append(float(loss))
        if len(self.ends) == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def summary(self) -> Dict[str, Any]:
        w = self.warmup
        last = None if self.measured is None else w + self.measured  # later steps are profiled, not timed
        times = [b - a for a, b in zip(self.ends[w - 1:last], self.ends[w:last])]
        if not times:
            raise RuntimeError("no measured steps")
        tokens = self.tokens[w:last]
        per_step = statistics.median(tokens)
        step_s = statistics.median(times)
        out = {"tokens_per_step": int(per_step), "step_ms": 1e3 * step_s, "tokens_per_s": per_step / step_s,
               "step_ms_all": [round(1e3 * t, 3) for t in times],
               "warmup_step_ms": [round(1e3 * (b - a), 1) for a, b in zip(self.ends[:w - 1], self.ends[1:w])],
               "final_loss": self.losses[-1]}
        if self.device.type == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        else:
            out["peak_gib"] = None
            out["process_max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return out


def make_profiler(args, device: torch.device, name: str, sync: bool = True):
    """A StepProfiler over the ``--profile`` steps that follow the timed ones (None without ``--profile``); with
    ``--trace`` it also writes them to ``<out>/trace_<name>.json.gz``. ``sync``: as the entry's StepTimer."""
    if not args.profile:
        return None
    stem = file_stem(name)
    trace = Path(args.out) / f"trace_{stem}.json.gz" if args.trace else None
    return StepProfiler(skip=args.warmup + args.steps, active=args.profile, device=device, trace_path=trace,
                        sync=sync)


def file_stem(name: str) -> str:
    """An entry's name as a portable file name (letters, digits, ``_ . -``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", Path(name).stem if name.endswith((".yaml", ".yml")) else name)


VARIANT_SECTIONS = ("model", "optim", "runtime")


def split_variant(spec: str) -> Tuple[str, Dict[str, List[str]]]:
    """``CONFIG[:model.KEY=VALUE][:optim.KEY=VALUE][:runtime.KEY=VALUE]...`` -> (config, {section: overrides})."""
    base, *overrides = spec.split(":")
    by_section: Dict[str, List[str]] = {name: [] for name in VARIANT_SECTIONS}
    for item in overrides:
        section, _, rest = item.partition(".")
        if section not in VARIANT_SECTIONS or "=" not in rest:
            raise SystemExit(f"--configs: {spec!r}: each override after ':' must be model.KEY=VALUE, "
                             f"optim.KEY=VALUE or runtime.KEY=VALUE, got {item!r}")
        by_section[section].append(rest)
    return base, by_section


def steps_to_run(args, late: bool) -> int:
    """Warm-up, timed and profiled steps, and with the results read one step late one more when profiling: the
    profiler's window of a step runs from its read to the next one's, so the last profiled step needs a later read
    (the run's last step is read at once, right after the step before it)."""
    return args.warmup + args.steps + args.profile + (1 if late and args.profile else 0)


def profile_result(profiler) -> Dict[str, Any]:
    return {"profile": profiler.summary()} if profiler is not None else {}


# -------------------------------------------------------------------------------------- ours

def run_ours(name: str, mb: int, args, data_dir: Path, run_root: Path) -> Dict[str, Any]:
    """One config (with its own overrides: :func:`split_variant`) through pretrain.py's own setup, engine and
    training loop."""

    cuda = torch.cuda.is_available()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    config, own = split_variant(name)
    sections = {
        "model": model_section(config, [*args.model_override, *own["model"]]),
        "data": {"path": str(data_dir), "seq_len": args.seq, "val_max_batches": 1, "sources": [],
                 "tokenizer": DEFAULT_TOKENIZER},
        "optim": {"micro_batch_size": mb, "global_batch_size": mb * world, "lr": 3.0e-4, "min_lr": 3.0e-5,
                  "warmup_steps": 0, "max_steps": steps_to_run(args, late=True), "weight_decay": 0.01,
                  "grad_clip": 1.0, "precision": args.precision, "zero_stage": 1, "seed": 42,
                  "activation_checkpointing": args.activation_checkpointing},
        "run": {"output_dir": str(run_root / f"{file_stem(name)}-mb{mb}"), "log_interval": 1, "eval_interval": 0,
                "save_interval": 0, "resume": False, "progress": False, "tensorboard": False, "export": False,
                "sample_tokens": 0},
    }
    for section in ("optim", "runtime"):
        for item in [*getattr(args, f"{section}_override"), *own[section]]:
            sections = deep_merge(sections, parse_override(f"{section}.{item}"))
    setup = prepare_pretraining(pretrain_config(sections))
    summary = model_summary(setup.config)
    n_mm = F.matmul_params(build_on_meta(setup.config))
    mixers = F.hybrid_mixers(setup.config, args.seq)
    # the loop reads each step's results (Readback) once the GPU has finished it, after launching the next step
    timer = StepTimer(args.warmup, setup.dist.device, args.steps, sync=False)
    profiler = make_profiler(args, setup.dist.device, name, sync=False)
    engine = None
    try:
        engine = build_engine(setup)
        train_loop(engine, setup.train_batches, setup.run, (), title=name, checkpoints=False,
                   on_step=lambda r: (timer(r), profiler and profiler(r)))
        timing = timer.summary()
        ranks = per_rank({"rank": setup.dist.rank, "peak_gib": timing["peak_gib"],
                          "peak_reserved_gib": timing.get("peak_reserved_gib"), **optimizer_shard_gib(engine)})
    finally:
        if engine is not None:
            engine.ds_engine.destroy()
        del engine
    return {"ranks": ranks, **profile_result(profiler), "params": summary["params"], "non_embedding_params": summary["non_embedding_params"],
            "matmul_params": n_mm, "mixers": F.describe(mixers),
            "overrides": own,
            "flops": F.train_flops_per_token(n_mm, mixers), "timing": timing,
            "precision": args.precision,
            "recipe": f"pretrain.py: DeepSpeed ZeRO-1 {PRECISION_RECIPE[args.precision]}, "
                      f"{'fused ' if cuda else ''}AdamW, clip 1.0, backend {setup.config.runtime.backend}"
                      f"{', activation checkpointing' if args.activation_checkpointing else ''} "
                      f"({'Triton' if cuda else 'torch'} kernels)"}


def optimizer_shard_gib(engine) -> Dict[str, Any]:
    """What ZeRO-1 leaves on this rank: its partition of the fp32 master weights and of AdamW's two moments, in
    GiB, and the trainable parameters of the whole model (each rank holds about 1 / world of the first two)."""
    zopt = engine.optimizer
    parts = getattr(zopt, "single_partition_of_fp32_groups", None)
    if parts is None:  # bf16 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
        parts = zopt.fp32_groups_flat_partition
    state = engine.ds_engine.basic_optimizer.state
    moments = sum(int(t.numel()) * t.element_size() for s in state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    return {"master_gib": sum(int(p.numel()) * p.element_size() for p in parts) / 2**30,
            "adam_moments_gib": moments / 2**30,
            "trainable_params": sum(int(p.numel()) for p in engine.module.parameters() if p.requires_grad)}


def per_rank(values: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``values`` of every rank, in rank order (this rank's alone in a one-process run)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [values]
    gathered: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, values)
    return gathered


# ------------------------------------------------------------------------------------- peers

def resolved_base(name: str, args, data_dir: Path):
    return resolve_model_config(model_section(name, args.model_override), read_meta(data_dir), data_dir)


LATE = "+late"  # a peer spec's suffix: its loss read one step late, as our loop reads its results


def read_late(spec: str) -> bool:
    return spec.endswith(LATE)


def run_peer(spec: str, mb: int, args, data_dir: Path, device: torch.device) -> Dict[str, Any]:
    """A peer in the plain loop a user would write: fp32 params, bf16 autocast, fused AdamW, clipping, the loss
    read as each step ends (``loss.item()``); with the ``+late`` suffix it is read after the next step is
    launched, as our training loop reads its results, so the host launches while the GPU works."""
    kind, _, base_name = spec.removesuffix(LATE).partition(":")
    base = resolved_base(base_name or PEER_BASE[kind], args, data_dir)
    torch.manual_seed(42)
    model, mixers, cfg = build_peer(kind, base, args)
    n_mm = F.matmul_params(model)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    bf16 = args.precision != "fp32"  # a peer trains fp32 weights under autocast for either bf16 setting
    batches = PackedBatches(PackedTokens(data_dir, "train"), args.seq, mb, 0, 1, DataConfig.seed)
    late = read_late(spec)
    timer = StepTimer(args.warmup, device, args.steps, sync=not late)
    profiler = make_profiler(args, device, spec, sync=not late)
    opt = None

    def finished(tokens: int, loss: Readback) -> None:
        timer.record(tokens, loss.tolist()[0])
        if profiler:
            profiler()

    try:
        model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3.0e-4, betas=(0.9, 0.95), weight_decay=0.01,
                                fused=device.type == "cuda")
        before = None  # the step launched before this one, its loss not read yet (one step late)
        for _ in range(steps_to_run(args, late)):
            ids = next(batches)["input_ids"].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=ids, labels=ids).loss  # the model shifts the labels itself
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            this = (ids.numel(), Readback(loss.detach().float().reshape(1)))
            if not late:
                finished(*this)
                continue
            if before is not None:
                finished(*before)
            before = this
        if before is not None:
            finished(*before)
    finally:
        del opt, model
    recipe = ("plain PyTorch: fp32 params" + (", bf16 autocast" if bf16 else "") + ", torch AdamW"
              + (" (fused)" if device.type == "cuda" else "") + ", clip 1.0"
              + (", each loss read after the next step is launched" if late else ""))
    return {**profile_result(profiler), "params": params, "non_embedding_params": params - emb, "matmul_params": n_mm,
            "mixers": F.describe(mixers), "flops": F.train_flops_per_token(n_mm, mixers),
            "timing": timer.summary(), "precision": args.precision, "recipe": recipe, "peer_config": cfg,
            "shapes_of": base_name or PEER_BASE[kind]}


# ------------------------------------------------------------------------------------- driver

def measure(name: str, kind: str, fn: Callable[[int], Dict[str, Any]], candidates: List[int], catch_oom: bool,
            args, world: int) -> Dict[str, Any]:
    """Run ``fn(micro_batch)`` over the candidates (largest first) until one fits; one entry of the report. With
    ``--keep-going`` an entry that raises anything but an OOM is reported as failed, with its error, and the run
    goes on to the next entry (main exits non-zero at the end)."""
    tried: Dict[str, str] = {}
    entry: Dict[str, Any] = {"name": name, "kind": kind}
    for mb in candidates:
        failed = None
        try:
            res = fn(mb)
        except Exception as e:  # noqa: BLE001 - OOM is caught; anything else re-raised unless --keep-going
            if not (catch_oom and is_oom(e)):
                if not getattr(args, "keep_going", False) or world > 1:
                    raise
                traceback.print_exc()
                free_memory()
                entry.update(status=FAILED, micro_batch=mb, reason=f"{type(e).__name__}: {e}".splitlines()[0])
                return entry
            failed = OOM
            res = None
        free_memory()
        if failed:
            tried[str(mb)] = failed
            continue
        tried[str(mb)] = "ok"
        t = res.pop("timing")
        entry.update(status="ok", micro_batch=mb, global_batch=mb * world, seq_len=args.seq, **t, **res)
        entry["tokens_per_s_per_gpu"] = entry["tokens_per_s"] / world
        entry["flops_per_token"] = entry["flops"]["total"]
        entry["model_tflops_per_s"] = entry["flops_per_token"] * entry["tokens_per_s"] / 1e12
        entry["mfu"] = F.mfu(entry["flops_per_token"], entry["tokens_per_s"], args.peak_tflops, world)
        break
    else:
        entry.update(status=OOM, micro_batch=candidates[-1])
    if len(candidates) > 1 or entry["status"] != "ok":
        entry["micro_batches_tried"] = tried
    return entry


def progress_line(entry: Dict[str, Any], t0: float) -> str:
    head = f"[{time.perf_counter() - t0:6.0f}s] {entry['kind']:<4} {entry['name']:<22}"
    if entry["status"] != "ok":
        return f"{head} {entry['status']}" + (f" ({entry['reason']})" if entry.get("reason") else "")
    peak = f"{entry['peak_gib']:6.1f} GiB" if entry.get("peak_gib") is not None else "  (cpu)"
    return (f"{head} mb={entry['micro_batch']:<3} {entry['tokens_per_s']:>11,.0f} tok/s {entry['step_ms']:9.1f} ms/step "
            f"MFU {100 * entry['mfu']:5.1f}%  peak {peak}  loss {entry['final_loss']:.3f}")


def _si(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def plot(report: Dict[str, Any], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["entries"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(entries) + 2), 4.8))
    top = max([e.get("tokens_per_s", 0.0) for e in entries if e["status"] == "ok"] or [1.0])
    for i, e in enumerate(entries):
        ok = e["status"] == "ok"
        peer = e["kind"] == "peer"
        h = e["tokens_per_s"] if ok else 0.0
        ax.bar(i, h, color="#c9a227" if peer else "#2a6f97", hatch="//" if peer else None, edgecolor="black",
               linewidth=0.6)
        label = (f"{_si(h)}\nMFU {100 * e['mfu']:.1f}%" if ok else
                 {OOM: "OOM", FAILED: "failed"}.get(e["status"], "skipped"))
        ax.text(i, h + 0.01 * top, label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(entries)))
    ax.set_xticklabels([e["name"] + (f"\nmb {e['micro_batch']}" if "micro_batch" in e else "") for e in entries],
                       rotation=30, ha="right",
                       fontsize=8)
    ax.set_ylabel(f"training tokens/s ({report.get('world_size', 1)} x {report.get('gpu') or 'cpu'})")
    ax.set_ylim(0, 1.18 * top)
    ax.set_title(f"Training throughput, seq {report.get('seq_len')}, {report.get('precision')} "
                 f"(hatched: peers in a plain PyTorch loop)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, png, dpi=120)


def write(report: Dict[str, Any], out: Path) -> None:
    write_report(report, out / "train_speed.json")
    plot(report, out / "train_speed.png")


def merge(paths: Sequence[str], out: Path) -> Dict[str, Any]:
    """Entries of several reports; a later report's entry replaces an earlier one of the same name, kind and
    micro-batch (the same entry at another micro-batch is another measurement, kept). The header's
    ``micro_batch`` is dropped: each entry carries its own."""
    _, merged = merge_reports(paths, lambda e: (e["kind"], e["name"], e.get("micro_batch")), derived=("micro_batch",))
    write(merged, out)
    return merged


# --<op>-kernel switches (ours: runtime.<op>_kernel, hybridlm/model/runtime.py): what the op is, ours, fla's
KERNEL_SWITCHES = {
    "conv": ("the mixers' short convs", "hybridlm/ops/causal_conv.py", "fla's causal_conv1d"),
    "norm": ("the RMSNorms, residual-add RMSNorms and Mamba2's output stage",
             "hybridlm/ops/rms_norm.py and hybridlm/ops/gated_norm.py", "fla's rms_norm and grouped gated norm"),
    "loss": ("the LM-head cross-entropy", "hybridlm/ops/cross_entropy.py", "fla's fused cross-entropy"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for train_speed.json and train_speed.png")
    p.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS,
                   help="model YAML names in configs/models (or paths), each optionally with overrides of its own "
                        "(gdn_300m:optim.step_on_device=true:runtime.split_conv_outputs=true); none: peers only")
    p.add_argument("--peers", nargs="*", default=DEFAULT_PEERS,
                   help="fla_gdn, fla_kda, llama, each optionally :CONFIG for its shapes; none: ours only")
    p.add_argument("--micro-batch", type=int, default=32, help="sequences per GPU per step")
    p.add_argument("--find-max-batch", action="store_true",
                   help="per entry, measure the largest of --batch-candidates that fits (one process only)")
    p.add_argument("--batch-candidates", type=int, nargs="+", default=[64, 48, 32, 16, 8, 4, 2, 1])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12, help="measured steps (median)")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring (>= 1; the first autotunes)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="ours: recompute blocks in the backward pass (optim.activation_checkpointing)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, N more under torch.profiler: profile_<entry>.json (time per category)")
    p.add_argument("--data", default=None,
                   help=f"prepared packed shards (default {DEFAULT_DATA}, prepared from Jane Austen with the "
                        "Llama-3.2 tokenizer when absent)")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="ours: the engine's precision (the peers "
                   "train fp32 weights under bf16 autocast for either bf16 setting); default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--peak-tflops", type=float, default=F.H200_BF16_DENSE_TFLOPS,
                   help="peak dense FLOP/s per GPU for MFU (H200 bf16: 989.5)")
    p.add_argument("--model-override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="model keys for every config and peer base, e.g. hidden_size=64")
    p.add_argument("--optim-override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="optim keys for ours, e.g. immediate_grad_update=true")
    p.add_argument("--runtime-override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="runtime keys for ours (hybridlm/model/runtime.py), e.g. fuse_projections=false")
    p.add_argument("--trace", action="store_true",
                   help="with --profile: also write each entry's profiled steps as a Chrome trace with Python stacks "
                        "(trace_<entry>.json.gz beside the report; python -m benchmarks.harness.trace_gaps reads it)")
    p.add_argument("--fla-fused-linear-ce", action="store_true",
                   help="fla peers with fuse_linear_cross_entropy (default: fla's default fuse_cross_entropy)")
    p.add_argument("--mamba2-compile-inputs", choices=("on", "off"), default="off",
                   help="ours: Mamba2's SSD inputs (dt softplus, decay, the scaled and head-broadcast B and C) "
                        "through torch.compile on the Triton path (hybridlm/ops/mamba2_inputs.py; off, the default, "
                        "is the eager ops)")
    p.add_argument("--conv-x-once", choices=("on", "off"), default="off",
                   help="ours: offer the project conv backward's autotuner the pre-activation from the products' x "
                        "tile (hybridlm/ops/causal_conv.py offer_pass1_x_once; off by default: not picked at the "
                        "300M shapes)")
    for op, (what, ours, theirs) in KERNEL_SWITCHES.items():
        p.add_argument(f"--{op}-kernel", choices=KERNEL_SOURCES, default="project",
                       help=f"ours: the Triton kernel of {what} (project: {ours}, fla: {theirs})")
    p.add_argument("--keep-going", action="store_true",
                   help="an entry that fails (not an OOM) is reported as failed and the next one runs; exit 1 at the "
                        "end (one-process runs)")
    p.add_argument("--compare-to", default=None,
                   help="a train_speed.json (e.g. of one GPU): adds each entry's tokens/s ratio to it")
    p.add_argument("--run-dir", default=None, help="where the runs' metrics go (default: a temp dir, removed)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="only merge these reports into --out (JSON + PNG), run nothing")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    if args.merge:
        return merge(args.merge, out)

    t0 = time.perf_counter()
    if args.mamba2_compile_inputs == "on":  # a runtime setting of ours (hybridlm/model/runtime.py)
        args.runtime_override = [*args.runtime_override, "compile_ssd_inputs=true"]
    for op in KERNEL_SWITCHES:  # runtime.<op>_kernel of ours; a config's own runtime overrides come after these
        choice = getattr(args, f"{op}_kernel")
        if choice != "project":
            args.runtime_override = [*args.runtime_override, f"{op}_kernel={choice}"]
    offer_pass1_x_once(args.conv_x_once == "on")
    dist = init_distributed()
    world, main_rank, device = dist.world_size, dist.rank == 0, dist.device
    cuda = device.type == "cuda"
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if args.find_max_batch and world > 1:
        raise SystemExit("--find-max-batch runs in one process (an OOM on one rank would hang the others); "
                         "pass --micro-batch for multi-GPU runs")
    candidates = sorted(set(args.batch_candidates), reverse=True) if args.find_max_batch else [args.micro_batch]

    data_dir = Path(args.data or DEFAULT_DATA).expanduser()
    if not data_dir.is_absolute():
        data_dir = Path.cwd() / data_dir
    if main_rank:  # only the default corpus is prepared here; another path must hold prepared shards
        sources = [] if (data_dir / "meta.json").is_file() or args.data else DEFAULT_SOURCES
        ensure_prepared(DataConfig(path=str(data_dir), sources=sources, tokenizer=DEFAULT_TOKENIZER,
                                   seq_len=args.seq), progress=False)
    barrier()

    report: Dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if cuda else None, "world_size": world,
        **versions(), "seq_len": args.seq, "micro_batch": None if args.find_max_batch else args.micro_batch,
        "find_max_batch": args.find_max_batch, "steps": args.steps, "warmup": args.warmup,
        "precision": args.precision, "peak_tflops_per_gpu": args.peak_tflops, "flop_formula": F.FORMULA,
        "mamba2_compile_inputs": args.mamba2_compile_inputs, "conv_x_once": args.conv_x_once,
        **{f"{op}_kernel": getattr(args, f"{op}_kernel") for op in KERNEL_SWITCHES},
        "model_override": args.model_override, "runtime_override": args.runtime_override, "data": str(data_dir), "command": " ".join(sys.argv),
        "started": datetime.now(timezone.utc).isoformat(),
        "entries": [],
    }
    baseline = None
    if args.compare_to:
        base_report = json.loads(Path(args.compare_to).read_text())
        baseline = {(e["kind"], e["name"]): e for e in base_report["entries"]}
        report["compared_to"] = {"path": args.compare_to, "world_size": base_report.get("world_size"),
                                 "gpu": base_report.get("gpu")}

    def add(entry: Dict[str, Any]) -> None:
        base = baseline.get((entry["kind"], entry["name"])) if baseline else None
        if base and base.get("status") == "ok" and entry["status"] == "ok":
            entry["tokens_per_s_ratio_to_baseline"] = entry["tokens_per_s"] / base["tokens_per_s"]
        report["entries"].append(entry)
        if main_rank:
            print(progress_line(entry, t0), flush=True)
            if entry.get("profile"):
                print(format_profile(entry["profile"]), flush=True)
            write(report, out)

    run_root = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="train_speed-"))
    try:
        for name in args.configs:
            add(measure(Path(name).stem if name.endswith((".yaml", ".yml")) else name, "ours",
                        lambda mb, name=name: run_ours(name, mb, args, data_dir, run_root),
                        candidates, catch_oom=world == 1, args=args, world=world))
        for spec in args.peers:
            kind = spec.removesuffix(LATE).split(":")[0]
            if kind not in PEER_BASE:
                raise SystemExit(f"--peers: unknown peer {kind!r}; expected one of {', '.join(PEER_BASE)}")
            entry = {"name": spec, "kind": "peer", "status": "skipped"}
            if world > 1:
                entry["reason"] = "peers run only in a one-process run"
            elif kind.startswith("fla_") and not cuda:
                entry["reason"] = "fla's Triton kernels need a CUDA device"
            else:
                entry = measure(spec, "peer", lambda mb, spec=spec: run_peer(spec, mb, args, data_dir, device),
                                candidates, catch_oom=True, args=args, world=1)
            add(entry)
    finally:
        if not args.run_dir:
            shutil.rmtree(run_root, ignore_errors=True)
    barrier()
    if main_rank:
        print(f"wrote {out / 'train_speed.json'} and {out / 'train_speed.png'}", flush=True)
    failed = [e["name"] for e in report["entries"] if e["status"] == FAILED]
    if failed:
        raise SystemExit(f"train_speed: {len(failed)} entries failed: {', '.join(failed)} (their errors are in the "
                         f"report and above)")
    return report


if __name__ == "__main__":
    main()
