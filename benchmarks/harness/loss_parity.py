"""Loss parity: our model and a peer of identical shape trained side by side on the very same batches.

    python -m benchmarks.harness.loss_parity --family gdn|kda|mamba2 --steps 300 --out DIR \\
        [--config gdn_300m] [--model-override hidden_size=256 ...] [--peer fla|hf|ours] \\
        [--seeds 0 1] [--ours-seeds 0] [--micro-batch 8] [--seq 2048] [--lr 6e-4 --min-lr 6e-5 --warmup 30] \\
        [--ours-init fla peer legacy legacy:conv legacy:conv_bias+mamba2_out_proj] [--data DIR]

**Ours** is ``HybridForCausalLM`` built from a model YAML (``--config``, default ``configs/models/
{gdn,kda,mamba2}_300m.yaml``; ``--model-override key=value`` changes shapes, e.g. for small CPU runs).
``--ours-init`` lists init variants, each trained as one more "ours" run against the same peer runs (the
ablation table): ``fla`` (the default: fla's statistics), ``legacy`` (everything this toolkit did before,
:func:`benchmarks.harness.legacy_init.apply_legacy_init`), ``legacy:PART+PART`` (only those parts back to the
old init; parts ``conv``, ``conv_bias``, ``mamba2_out_proj``), ``peer`` (the exact initial weights of the peer
built with that run's seed, copied tensor by tensor: :mod:`benchmarks.harness.peer_weights`; a ``peer`` run that
follows the peer's curve puts a gap on the initialisation, one that follows ours' on the rest: forward numerics,
parameterisation) or ``peer:NAME+NAME`` (only the tensors with those name components, e.g. ``peer:out_proj``,
``peer:conv1d+A_log``, from the peer; the rest our own init: the peer's init part by part).

**Peers** (``--peer``, default ``fla``), built with the shapes of ours (the parameter counts are printed and
must match): fla's ``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM`` (as in :mod:`benchmarks.harness.peers`)
and fla's ``Mamba2ForCausalLM``; ``hf``: transformers' ``Mamba2ForCausalLM`` (mamba2 only; its own init);
``ours``: our model again with the peer seeds (``--peer-init``, a variant as above, picks its init), the
peer that runs on a CPU. fla's models run Triton kernels and need CUDA. fla's and transformers' Mamba2 blocks
have no MLP, so for ``--family mamba2`` our pattern becomes one Mamba2 mixer per sublayer of the config
(``M-M-...`` of 24 sublayers -> ``MMMM...`` of 24 mixers) unless ``--keep-pattern`` (peer ``ours`` only).
Without mamba_ssm both Mamba2 peers take their naive torch SSD, whose memory grows with the chunk length:
``--peer-chunk-size`` (default 64) sets it. For transformers' peer ``--peer-ssd chunked`` (the default) swaps
that SSD for a chunked kernel of the same function (fla's on CUDA; :mod:`benchmarks.harness.peer_ssd`), after
checking loss and gradients against the reference on the first batch (``peer_ssd_check`` in the report).
fla's gives head ``h`` the B / C of group ``h % n_groups`` where mamba_ssm, transformers and ours give each group consecutive heads: with ``1 < n_groups < heads`` it is another
wiring of the same weights (the run's ``note`` says so; :mod:`benchmarks.harness.peer_weights`).

Both train in the same plain torch loop: fp32 weights, bf16 autocast on CUDA (fp32 on CPU), AdamW with the
engine's parameter groups (:func:`hybridlm.engine.build_param_groups`: 1-D parameters and ``_no_weight_decay``
tags are not decayed), the same betas / eps / weight decay, global-norm clipping, linear warmup + cosine to
``--min-lr`` (:func:`hybridlm.engine.schedule.lr_lambda`), and the same loss convention (``labels = input_ids``,
shifted inside each model). The batches come from the project's packed data (``PackedBatches``, the training
loader's order, independent of the model seed); validation every ``--val-interval`` steps on the first
``--val-batches`` batches of the held-out split. Every step records the batch's hash and first tokens and the
learning rate; the report says whether they were identical for every run (and the command exits 2 if not).

Writes ``DIR/loss_parity.json`` (after every run, so a cut-off call keeps the finished runs; a SIGTERM, e.g. from
``timeout``, ends the run in progress after its step with ``cut_at`` and its curve so far) and, at the end,
``DIR/loss_parity.png`` (train loss, 10-step running mean; validation loss; gradient norm); ``--replot --out
DIR`` redraws the chart from the JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import torch

from benchmarks.harness.common import (DEFAULT_DATA, DEFAULT_SOURCES, DEFAULT_TOKENIZER, free_memory, model_section,
                                   versions, write_report)
from benchmarks.harness import peer_ssd
from benchmarks.harness.peer_norm import NORMS, set_gated_norms
from benchmarks.harness.peer_weights import fla_mamba2_reads_groups_tiled, load_peer_weights
from benchmarks.harness.peers import build_peer as speed_peer
from hybridlm.data import DataConfig, PackedBatches, PackedTokens, ensure_prepared, read_meta, validation_batches
from hybridlm.engine import Engine, OptimConfig, build_param_groups
from hybridlm.engine.config import PRECISIONS
from hybridlm.engine.schedule import lr_lambda
from hybridlm.model import HybridForCausalLM
from hybridlm.model.configuration import resolve_model_config
from benchmarks.harness.legacy_init import LEGACY_PARTS, apply_legacy_init, check_legacy_parts
from hybridlm.training.preempt import STOP, StopRequest
from hybridlm.utils.atomic import save_figure

FAMILIES = ("gdn", "kda", "mamba2")
DEFAULT_CONFIG = {"gdn": "gdn_300m", "kda": "kda_300m", "mamba2": "mamba2_300m"}
PEERS = ("fla", "hf", "ours")
PEER_INIT = "peer"  # the init variant of ours that copies the peer's initial weights
SMOOTH = 10  # running-mean window of the train-loss curve


# ------------------------------------------------------------------------------------------ models

def resolve_config(args, data_dir: Path, name: Optional[str] = None, overrides: Optional[List[str]] = None):
    """Our HybridConfig: the model YAML (``name``, default ``--config``) with the overrides (default
    ``--model-override``), vocabulary from the data; for ``mamba2`` against a Mamba2-only peer, one mixer per
    sublayer. Its sequence mixers must be ``--family``, with MLA allowed beside it when the run compares two
    architectures of ours (``--peer-config``)."""

    name = name or args.config
    overrides = args.model_override if overrides is None else overrides
    section = dict(model_section(name, overrides))
    overridden = {o.split("=", 1)[0] for o in overrides}
    if "hybrid_override_pattern" in overridden and "num_layers" not in overridden:
        section.pop("num_layers", None)  # the new pattern gives the depth
    config = resolve_model_config(section, read_meta(data_dir), data_dir)
    mixers = {k for k in config.layer_plan if k != "mlp"}
    allowed = {args.family, "mla"} if args.peer_config else {args.family}
    if args.family not in mixers or not mixers <= allowed:
        raise SystemExit(f"--family {args.family}: {name}'s sequence mixers are {sorted(mixers)}")
    if args.family == "mamba2" and not args.keep_pattern and "mlp" in config.layer_plan:
        section["hybrid_override_pattern"] = "M" * len(config.layer_plan)
        section.pop("num_layers", None)
        config = resolve_model_config(section, read_meta(data_dir), data_dir)
    return config


def parse_variant(text: str):
    """``fla`` and ``peer`` -> no legacy parts; ``legacy`` -> all of them; ``legacy:conv+mamba2_out_proj`` ->
    those; ``peer:out_proj+A_log`` -> no legacy parts (the names are :func:`peer_parts`')."""
    kind, sep, parts = text.partition(":")
    if kind in ("fla", PEER_INIT) and not sep:
        return []
    if kind == PEER_INIT:
        peer_parts(text)
        return []
    if kind != "legacy":
        raise ValueError(f"init variant {text!r}: expected fla, peer, peer:NAME+NAME, legacy or legacy:PART+PART")
    return check_legacy_parts(parts.split("+")) if parts else list(LEGACY_PARTS)


def peer_parts(variant: str) -> Optional[List[str]]:
    """``peer`` -> None (every tensor from the peer); ``peer:out_proj+conv1d`` -> those names: only our tensors
    whose dotted name has one of them as a component (``out_proj`` matches ``model.layers.3.mixer.out_proj.weight``)
    are copied from the peer, the rest keep our init: an ablation of the peer's init part by part."""
    kind, sep, parts = variant.partition(":")
    if kind != PEER_INIT:
        raise ValueError(f"init variant {variant!r}: not a peer variant")
    names = [n for n in parts.split("+") if n] if sep else None
    if sep and not names:
        raise ValueError(f"init variant {variant!r}: expected peer:NAME+NAME (e.g. peer:out_proj+A_log)")
    return names


def build_ours(config, seed: int, variant: str = "fla", args=None):
    """(our model, description) with the init ``variant``; ``peer`` / ``peer:NAMES`` need ``args`` (``--peer``,
    ``--family`` and the peer's options) to build the peer whose weights they copy."""

    if variant.partition(":")[0] == PEER_INIT:
        return ours_from_peer(config, seed, args, variant)
    parts = parse_variant(variant)
    torch.manual_seed(seed)
    model = HybridForCausalLM(config)
    touched = apply_legacy_init(model, parts, config.initializer_range) if parts else []
    return model, {"class": "HybridForCausalLM", "init": variant, "legacy_parts": parts,
                   "legacy_params": len(touched)}


def ours_from_peer(config, seed: int, args, variant: str = PEER_INIT):
    """Our model holding the initial weights of the peer built with ``seed`` (the ``peer`` variant: the same
    starting point, so what still differs is the forward and the parameterisation), or only the tensors that
    ``peer:NAMES`` names (:func:`peer_parts`), the others from our own init with the same seed."""

    if args is None:
        raise ValueError(f"init variant {variant!r} copies the peer's weights: build_ours needs the bench's args")
    names = peer_parts(variant)
    peer, peer_info = build_peer(args.peer, args.family, config, seed, args)
    torch.manual_seed(seed)
    model = HybridForCausalLM(config)  # its own init, overwritten where the peer's tensors are copied
    try:
        copied = load_peer_weights(model, peer, args.peer, args.family, names)
    except ValueError as e:
        raise ValueError(f"init variant {variant!r}: {e}") from None
    del peer
    info = {"class": "HybridForCausalLM", "init": variant, "legacy_parts": [], "legacy_params": 0,
            "weights_from": peer_info["class"], "weights_from_seed": seed, "copied_tensors": copied}
    if "note" in peer_info:  # the peer computes another function of these weights
        info["note"] = peer_info["note"]
    return model, info


def build_peer(kind: str, family: str, config, seed: int, args):
    """(model, description) of the peer with ``config``'s shapes."""
    if kind == "ours":
        return build_ours(config, seed, args.peer_init)
    torch.manual_seed(seed)
    if family in ("gdn", "kda"):
        if kind != "fla":
            raise SystemExit(f"--peer {kind}: the {family} peers are fla (CUDA) or ours")
        shim = SimpleNamespace(seq=args.seq, fla_fused_linear_ce=False)
        model, _, cfg = speed_peer("fla_gdn" if family == "gdn" else "fla_kda", config, shim)
        return model, {"class": type(model).__name__, "config": cfg, "init": "its own (_init_weights)"}
    a = config.mixer_args("mamba2")
    if a.d_xb is not None and a.d_xb != a.d_inner:
        raise SystemExit("--family mamba2: the peers have no d_xb (grouped x / B)")
    n_layers = sum(1 for k in config.layer_plan if k == "mamba2")
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, state_size=a.d_state,
                  num_hidden_layers=n_layers, head_dim=a.head_dim, expand=a.d_inner // config.hidden_size,
                  n_groups=a.n_groups, conv_kernel=a.conv_size, use_conv_bias=a.conv_bias, use_bias=False,
                  initializer_range=config.initializer_range, tie_word_embeddings=config.tie_word_embeddings,
                  chunk_size=args.peer_chunk_size, bos_token_id=config.bos_token_id,
                  eos_token_id=config.eos_token_id, pad_token_id=None, use_cache=False)
    if a.d_inner % config.hidden_size:
        raise SystemExit("--family mamba2: the peers need d_inner = expand * hidden_size")
    if kind == "fla":
        from fla.models import Mamba2Config, Mamba2ForCausalLM
        cfg = Mamba2Config(norm_eps=config.rms_norm_eps, norm_before_gate=False, **common)
    else:
        from transformers import Mamba2Config, Mamba2ForCausalLM
        cfg = Mamba2Config(num_heads=a.d_inner // a.head_dim, layer_norm_epsilon=config.rms_norm_eps, **common)
    model = Mamba2ForCausalLM(cfg)
    info = {"class": f"{'fla' if kind == 'fla' else 'transformers'}.{type(model).__name__}",
            "config": cfg.to_diff_dict(), "init": "its own (_init_weights)"}
    if kind == "hf":
        set_gated_norms(model, args.peer_norm)  # whatever transformers is installed (benchmarks/harness/peer_norm.py)
        info["norm"] = args.peer_norm
    if kind == "fla":
        if fla_mamba2_reads_groups_tiled(model):
            info["note"] = ("without mamba_ssm fla's torch SSD gives head h the B / C of group h % n_groups, ours "
                            "of group h // (heads per group): the same weights compute another function "
                            "(benchmarks/harness/peer_weights.py)")
    return model, info


# the chunked SSD may differ from the reference by rounding (bf16 operands), not more
PEER_SSD_MAX_LOSS_DIFF = 0.02
PEER_SSD_MIN_GRAD_COSINE = 0.98


def check_peer_ssd(args, config, data_dir: Path, device: torch.device) -> Optional[Dict[str, float]]:
    """``--peer-ssd chunked``: compare transformers' Mamba2 on the first training row with its reference SSD
    and with the chunked kernel (loss and every gradient), then run the peers with the kernel; exit if they
    differ beyond rounding. One row keeps the reference's transient memory small."""
    if args.peer_ssd == "reference":
        return None
    op = peer_ssd.fla_gla_op if device.type == "cuda" else peer_ssd.torch_gla_op
    model, _ = build_peer("hf", args.family, config, args.seeds[0], args)
    ids = next(train_batches(data_dir, args.seq, args.micro_batch))["input_ids"][:1].to(device)
    check = peer_ssd.compare_on_batch(model.to(device).train(), ids, op, autocast=device.type == "cuda")
    del model
    free_memory()
    print(f"peer SSD: chunked kernel against transformers' reference on one row: loss {check['kernel_loss']:.5f} "
          f"vs {check['reference_loss']:.5f}, min grad cosine {check['min_grad_cosine']:.5f}, max grad rel diff "
          f"{check['max_grad_rel_diff']:.4f}", flush=True)
    if check["loss_diff"] > PEER_SSD_MAX_LOSS_DIFF or check["min_grad_cosine"] < PEER_SSD_MIN_GRAD_COSINE:
        raise SystemExit("error: --peer-ssd chunked: the kernel's loss / gradients differ from transformers' "
                         f"reference SSD ({check}); run with --peer-ssd reference")
    peer_ssd.install(op)
    return check


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------- training

def batch_hash(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.cpu().numpy().tobytes()).hexdigest()[:16]


def train_batches(data_dir: Path, seq: int, micro_batch: int):
    """The training loader's batches in its order (the data seed, not the model seed, fixes it)."""
    return PackedBatches(PackedTokens(data_dir, "train"), seq, micro_batch, 0, 1, DataConfig.seed)


def val_batches(data_dir: Path, seq: int, micro_batch: int, n: int) -> List[Dict[str, torch.Tensor]]:
    return validation_batches(PackedTokens(data_dir, "val"), seq, micro_batch, n)


def lm_loss(model, ids: torch.Tensor, device: torch.device, bf16: bool) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        return model(input_ids=ids, labels=ids).loss  # every model shifts the labels itself


@torch.no_grad()
def evaluate(model, batches, device, bf16: bool) -> float:
    model.eval()
    losses = [lm_loss(model, b["input_ids"].to(device), device, bf16).float().item() for b in batches]
    model.train()
    return sum(losses) / len(losses)


def stop_if_signalled(rec: Dict[str, Any], step: int, flag: Optional[StopRequest], label: str) -> bool:
    """A time limit's SIGTERM (``timeout``): the run ends after this step with ``cut_at``, its curve so far kept
    in the report (not resumable: ``--resume`` keeps whole runs only)."""
    if flag is None or not flag.signal_name:
        return False
    rec["cut_at"] = step
    print(f"  {label}: {flag.signal_name} at step {step}; keeping the curve so far and stopping", flush=True)
    return True


def final_val_loss(rec: Dict[str, Any]) -> Optional[float]:
    """The last validation loss of a run that reached its end (None for one that diverged or was cut)."""
    return rec["val"][-1]["loss"] if rec["val"] and not {"diverged_at", "cut_at"} & set(rec) else None


def train_run(model, args, data_dir: Path, device: torch.device, val, label: str,
              flag: Optional[StopRequest] = None) -> Dict[str, Any]:
    """One model through the shared loop; per-step loss, lr, grad norm, batch hash and first tokens."""

    cuda = device.type == "cuda"
    bf16 = args.precision == "bf16"
    model.to(device).train()
    groups = build_param_groups(model, args.weight_decay)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), eps=args.eps, fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lr=args.lr, min_lr=args.min_lr,
                                                             warmup_steps=args.warmup, max_steps=args.steps))
    batches = train_batches(data_dir, args.seq, args.micro_batch)
    rec: Dict[str, Any] = {"train_loss": [], "lr": [], "grad_norm": [], "batch_hash": [], "first_tokens": [],
                           "val": [], "param_groups": [{"weight_decay": g["weight_decay"], "tensors": len(g["params"]),
                                                        "numel": sum(p.numel() for p in g["params"])} for g in groups]}
    max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = next(batches)["input_ids"]
        rec["batch_hash"].append(batch_hash(ids))
        rec["first_tokens"].append(ids[0, :4].tolist())
        rec["lr"].append(opt.param_groups[0]["lr"])
        loss = lm_loss(model, ids.to(device, non_blocking=True), device, bf16)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rec["train_loss"].append(loss.item())
        rec["grad_norm"].append(norm.item())
        if not math.isfinite(rec["train_loss"][-1]):
            rec["diverged_at"] = step
            print(f"  {label}: non-finite loss at step {step}; stopping this run", flush=True)
            break
        if step % args.val_interval == 0 or step == args.steps:
            rec["val"].append({"step": step, "loss": evaluate(model, val, device, bf16)})
        if step % args.log_interval == 0 or step == args.steps:
            v = f"  val {rec['val'][-1]['loss']:.4f}" if rec["val"] and rec["val"][-1]["step"] == step else ""
            print(f"  {label} step {step:5d}  loss {rec['train_loss'][-1]:.4f}  lr {rec['lr'][-1]:.3e}  "
                  f"gnorm {rec['grad_norm'][-1]:.3f}{v}", flush=True)
        if stop_if_signalled(rec, step, flag, label):
            break
    if cuda:
        torch.cuda.synchronize(device)
    rec["wall_s"] = time.perf_counter() - t0
    rec["final_val_loss"] = final_val_loss(rec)
    del opt, sched
    return rec


def engine_run(model, args, data_dir: Path, val, label: str, precision: str,
               flag: Optional[StopRequest] = None) -> Dict[str, Any]:
    """One model through the training engine every stage uses (``pretrain.py``'s DeepSpeed ZeRO-1 at
    ``precision``), with the bench's batches, loss, optimizer settings and schedule; the same record as
    :func:`train_run`."""

    groups = [{"weight_decay": g["weight_decay"], "tensors": len(g["params"]),
               "numel": sum(p.numel() for p in g["params"])} for g in build_param_groups(model, args.weight_decay)]
    cfg = OptimConfig(micro_batch_size=args.micro_batch, global_batch_size=args.micro_batch, lr=args.lr,
                      min_lr=args.min_lr, warmup_steps=args.warmup, max_steps=args.steps,
                      weight_decay=args.weight_decay, betas=tuple(args.betas), eps=args.eps,
                      grad_clip=args.grad_clip, precision=precision, zero_stage=1)
    engine = Engine(model, cfg, lambda m, b: (m(input_ids=b["input_ids"], labels=b["input_ids"]).loss, {}))
    batches = train_batches(data_dir, args.seq, args.micro_batch)
    rec: Dict[str, Any] = {"train_loss": [], "lr": [], "grad_norm": [], "batch_hash": [], "first_tokens": [],
                           "val": [], "engine_precision": precision, "param_groups": groups}
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = next(batches)
        ids = batch["input_ids"]
        rec["batch_hash"].append(batch_hash(ids))
        rec["first_tokens"].append(ids[0, :4].tolist())
        res = engine.train_step([{"input_ids": ids}])
        rec["lr"].append(res.lr)
        rec["train_loss"].append(res.loss)
        rec["grad_norm"].append(res.grad_norm)
        if not math.isfinite(res.loss):
            rec["diverged_at"] = step
            print(f"  {label}: non-finite loss at step {step}; stopping this run", flush=True)
            break
        if step % args.val_interval == 0 or step == args.steps:
            losses = [engine.eval_step({"input_ids": b["input_ids"]}).loss for b in val]
            rec["val"].append({"step": step, "loss": sum(losses) / len(losses)})
        if step % args.log_interval == 0 or step == args.steps:
            v = f"  val {rec['val'][-1]['loss']:.4f}" if rec["val"] and rec["val"][-1]["step"] == step else ""
            print(f"  {label} step {step:5d}  loss {res.loss:.4f}  lr {res.lr:.3e}  gnorm {res.grad_norm:.3f}{v}",
                  flush=True)
        if stop_if_signalled(rec, step, flag, label):
            break
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rec["wall_s"] = time.perf_counter() - t0
    rec["final_val_loss"] = final_val_loss(rec)
    engine.ds_engine.destroy()
    del engine
    return rec


# ---------------------------------------------------------------------------------------- report

def running_mean(xs: Sequence[float], k: int = SMOOTH) -> List[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def summarize(report: Dict[str, Any]) -> None:
    """Headline numbers and the same-batches / same-lr checks, from the runs done so far."""
    runs = report["runs"]
    variants = list(dict.fromkeys(r["init"] for r in runs if r["role"] == "ours"))
    ours = [r for r in runs if r["role"] == "ours" and r["init"] == variants[0]] if variants else []
    peers = [r for r in runs if r["role"] == "peer"]

    def vals(rs):
        return [r["final_val_loss"] for r in rs if r.get("final_val_loss") is not None]

    ov, pv = vals(ours), vals(peers)
    s: Dict[str, Any] = {
        "ours_val_loss": statistics.fmean(ov) if ov else None,
        "peer_val_loss": statistics.fmean(pv) if pv else None,
        "ours_val_losses": ov, "peer_val_losses": pv,
        "peer_seeds": [r["seed"] for r in peers], "ours_seeds": [r["seed"] for r in ours],
        "peer_spread": (max(pv) - min(pv)) if len(pv) > 1 else None,
        "peer_std": statistics.stdev(pv) if len(pv) > 1 else None,
        "ours_spread": (max(ov) - min(ov)) if len(ov) > 1 else None,
        "ours_step1_grad_norm": ours[0]["grad_norm"][0] if ours and ours[0]["grad_norm"] else None,
        "peer_step1_grad_norm": peers[0]["grad_norm"][0] if peers and peers[0]["grad_norm"] else None,
    }
    if s["ours_val_loss"] is not None and s["peer_val_loss"] is not None:
        s["gap"] = s["ours_val_loss"] - s["peer_val_loss"]
        if s["peer_spread"]:
            s["gap_over_peer_spread"] = s["gap"] / s["peer_spread"]
    s["ablation"] = []  # one row per init variant of ours (the first is the headline "ours")
    for v in variants:
        rs = [r for r in runs if r["role"] == "ours" and r["init"] == v]
        vl = vals(rs)
        row = {"init": v, "legacy_parts": rs[0]["legacy_parts"], "val_losses": vl,
               "val_loss": statistics.fmean(vl) if vl else None, "step1_grad_norm": rs[0]["grad_norm"][0]
               if rs[0]["grad_norm"] else None}
        if row["val_loss"] is not None and s["peer_val_loss"] is not None:
            row["gap_to_peer"] = row["val_loss"] - s["peer_val_loss"]
        s["ablation"].append(row)
    for key, first in (("ours", ours), ("peer", peers)):  # per-step curves of the first run of each side
        if first:
            for field, plural in (("train_loss", "train_losses"), ("lr", "lrs"), ("grad_norm", "grad_norms")):
                s[f"{key}_{plural}"] = first[0][field]
    report.update(s)
    if runs:
        n = min(len(r["batch_hash"]) for r in runs)
        report["checks"] = {
            "compared_steps": n,
            "same_batches": all(r["batch_hash"][:n] == runs[0]["batch_hash"][:n] for r in runs),
            "same_first_tokens": all(r["first_tokens"][:n] == runs[0]["first_tokens"][:n] for r in runs),
            "same_lrs": all(r["lr"][:n] == runs[0]["lr"][:n] for r in runs),
            "same_param_counts": len({r["params"] for r in runs}) == 1,
            "same_param_groups": len({str([(g["weight_decay"], g["numel"]) for g in r["param_groups"]])
                                      for r in runs}) == 1,
        }


def plot(report: Dict[str, Any], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    peer_colors = ["#c9a227", "#e07a1f", "#9c6644", "#b5838d"]
    ours_colors = ["#2a6f97", "#468faf", "#61a5c2", "#89c2d9"]
    n_ours = n_peer = 0
    for r in report["runs"]:
        if r["role"] == "ours":
            color, ls = ours_colors[n_ours % len(ours_colors)], "-"
            n_ours += 1
        else:
            color, ls = peer_colors[n_peer % len(peer_colors)], "--"
            n_peer += 1
        label = f"{r['name']} (seed {r['seed']})"
        steps = list(range(1, len(r["train_loss"]) + 1))
        axes[0].plot(steps, running_mean(r["train_loss"]), ls, color=color, label=label, lw=1.3)
        if r["val"]:
            axes[1].plot([v["step"] for v in r["val"]], [v["loss"] for v in r["val"]], ls, marker="o", ms=3,
                         color=color, label=label, lw=1.3)
        axes[2].plot(steps, r["grad_norm"], ls, color=color, label=label, lw=0.8)
    axes[0].set_title(f"train loss ({SMOOTH}-step mean)", fontsize=9)
    axes[1].set_title("validation loss", fontsize=9)
    axes[2].set_title("grad norm (before clipping)", fontsize=9)
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    params = f"{report['ours_params'] / 1e6:.1f}M params" if report["ours_params"] == report["peer_params"] else \
        f"{report['ours_params'] / 1e6:.1f}M / {report['peer_params'] / 1e6:.1f}M params"
    fig.suptitle(f"Loss parity, {report['family']}: {params}, "
                 f"mb {report['micro_batch']} x seq {report['seq_len']}, {report['steps']} steps, "
                 f"{report['precision']} on {report.get('gpu') or 'cpu'}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)


def write(report: Dict[str, Any], out: Path, chart: bool = True) -> None:
    summarize(report)
    write_report(report, out / "loss_parity.json")
    if chart:
        plot(report, out / "loss_parity.png")


def replot(out: Path) -> None:
    """Redraw ``out/loss_parity.png`` from ``out/loss_parity.json`` (e.g. of a run cut off before the end)."""
    plot(json.loads((out / "loss_parity.json").read_text()), out / "loss_parity.png")


def merge(paths: Sequence[str], out: Path) -> Dict[str, Any]:
    """One report from several made with the same settings (e.g. ``--only ours`` and ``--only peer`` run as two
    processes at once): the runs of all of them, summary and chart made anew. Refuses reports whose settings
    differ (the keys ``--resume`` compares) or that hold the same run twice."""
    reports = []
    for path in paths:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --merge: {path}: {e}")
    first = reports[0]
    for path, r in zip(paths[1:], reports[1:]):
        differ = [k for k in RESUME_KEYS if json.dumps(r.get(k), sort_keys=True) != json.dumps(first.get(k), sort_keys=True)]
        if differ:
            raise SystemExit(f"error: --merge: {path} was made with other settings than {paths[0]} ({', '.join(differ)})")
    merged = {k: v for k, v in first.items() if k not in ("runs", "finished")}
    merged["runs"], seen = [], set()
    for path, r in zip(paths, reports):
        for run in r.get("runs", []):
            key = (run["name"], run["seed"])
            if key in seen:
                raise SystemExit(f"error: --merge: run {run['name']!r} seed {run['seed']} is in more than one report ({path})")
            seen.add(key)
            merged["runs"].append(run)
    merged["seeds"] = sorted({s for r in reports for s in r.get("seeds", [])})
    merged["ours_init"] = list(dict.fromkeys(v for r in reports for v in r.get("ours_init", [])))
    merged["merged_from"] = [str(p) for p in paths]
    merged["commands"] = [r.get("command") for r in reports]
    merged["finished"] = max((r.get("finished") or "" for r in reports), default="") or None
    out.mkdir(parents=True, exist_ok=True)
    write(merged, out)
    return merged


# settings that must be equal for a finished run of an earlier report to stand beside this one's
RESUME_KEYS = ("family", "steps", "config", "model_override", "pattern", "peer", "peer_class", "peer_norm",
               "ours_params", "peer_params", "micro_batch", "seq_len", "precision", "optim", "val_interval",
               "val_batches", "val_batch_hashes", "data")


def run_name(args, role: str, variant: Optional[str], engine_precision: Optional[str]) -> str:
    """The name a run has in the report (and in --resume's matching)."""
    if role == "ours":
        name = "ours" + (f" {Path(args.config).stem}" if args.peer_config else "") + \
            (f" {variant} init" if variant != "fla" else "")
        return name + (f" engine {engine_precision}" if engine_precision else "")
    if args.peer_config:
        return f"ours {Path(args.peer_config).stem}"
    return f"peer {args.peer}" + (f" {args.peer_init} init" if args.peer == "ours" else "")


def resumable_runs(report: Dict[str, Any], out: Path) -> Dict[Any, Dict[str, Any]]:
    """The finished runs of ``out/loss_parity.json`` by (name, seed), if it was made with the same settings."""
    path = out / "loss_parity.json"
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text())
    except ValueError as e:
        raise SystemExit(f"error: --resume: {path} is not valid JSON ({e}); move it away to start afresh")
    differ = [k for k in RESUME_KEYS if json.dumps(old.get(k), sort_keys=True) != json.dumps(report.get(k), sort_keys=True)]
    if differ:
        raise SystemExit(f"error: --resume: {path} was made with other settings ({', '.join(differ)}); "
                         "use another --out or drop --resume")
    return {(r["name"], r["seed"]): r for r in old.get("runs", []) if len(r.get("train_loss", [])) == report["steps"]}



# ---------------------------------------------------------------------------------------- driver

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.loss_parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, help="required unless --replot or --merge")
    p.add_argument("--out", required=True, help="directory for loss_parity.json and loss_parity.png")
    p.add_argument("--replot", action="store_true", help="only redraw --out's chart from its JSON, run nothing")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="only join these reports (same settings, e.g. an --only ours and an --only peer process) "
                        "into --out, run nothing")
    p.add_argument("--only", choices=("ours", "peer"), default=None,
                   help="run only our runs or only the peer's (two such processes can share a GPU; join their "
                        "reports with --merge)")
    p.add_argument("--resume", action="store_true", help="keep the finished runs of --out's JSON (written by the "
                   "same command, e.g. one cut off by a time limit) and run only the missing ones")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--config", default=None, help="model YAML name in configs/models or a path "
                   "(default: gdn_300m / kda_300m / mamba2_300m)")
    p.add_argument("--model-override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="model keys, e.g. hidden_size=64 gdn.num_heads=2 hybrid_override_pattern=M-M-")
    p.add_argument("--keep-pattern", action="store_true",
                   help="mamba2: keep the config's MLP sublayers (only against --peer ours)")
    p.add_argument("--peer", choices=PEERS, default="fla")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="peer seeds (model init); several "
                   "measure the peer's seed-to-seed spread")
    p.add_argument("--ours-seeds", type=int, nargs="*", default=None, help="our seeds (default: the first of --seeds)")
    p.add_argument("--ours-init", nargs="+", default=["fla"], metavar="VARIANT",
                   help="init variants of ours, one run each: fla, legacy, legacy:PART+PART (parts conv, "
                        "conv_bias, mamba2_out_proj), peer (the initial weights of the --peer model built with "
                        "the same seed, copied), peer:NAME+NAME (only those tensors, e.g. peer:out_proj); the "
                        "first is the headline")
    p.add_argument("--ours-engine", nargs="*", default=[], metavar="PRECISION",
                   help="one more run of ours (first init variant and seed) per precision through the training "
                        "engine, as pretrain.py trains: bf16 (bf16 weights, fp32 master), bf16-mixed (fp32 "
                        "weights, autocast) or fp32")
    p.add_argument("--peer-init", default="fla", metavar="VARIANT", help="--peer ours: its init variant")
    p.add_argument("--peer-config", default=None, metavar="NAME",
                   help="--peer ours: build the peer from this model YAML instead (another architecture of ours, "
                        "e.g. gdn_300m against gdn_300m_hybrid on the same batches; counts may differ)")
    p.add_argument("--peer-model-override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="--peer-config: its model keys")
    p.add_argument("--peer-chunk-size", type=int, default=64,
                   help="mamba2 peers: chunk length of their naive torch SSD (memory grows with it)")
    p.add_argument("--peer-ssd", choices=("chunked", "reference"), default="chunked",
                   help="--peer hf: the SSD its mixers run: chunked (fla's chunk_simple_gla on CUDA, the project's "
                        "torch recurrence on a CPU; checked against the reference on the first batch before "
                        "training) or reference (transformers' own torch SSD, ~5 s a step at 300M, 8 x 2048)")
    p.add_argument("--peer-norm", choices=NORMS, default="grouped",
                   help="--peer hf: its gated RMSNorm over groups of d_inner / n_groups channels as in mamba_ssm and "
                        "ours, or over all of d_inner as transformers before 5.24 computes it (whatever version is "
                        "installed)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global norm; 0: none")
    p.add_argument("--val-interval", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="the plain loop's: bf16 autocast over "
                   "fp32 weights, or fp32 (default: bf16 on CUDA, fp32 on CPU); --ours-engine sets the engine runs'")
    p.add_argument("--data", default=None,
                   help=f"prepared packed shards (default {DEFAULT_DATA}, prepared from Jane Austen when absent)")
    p.add_argument("--allow-param-mismatch", action="store_true", help="train even if the counts differ")
    args = p.parse_args(argv)
    if args.replot or args.merge:
        return args
    if args.family is None:
        p.error("--family is required")
    try:
        for v in [*args.ours_init, args.peer_init]:
            parse_variant(v)
    except ValueError as e:
        p.error(str(e))
    for prec in args.ours_engine:
        if prec not in PRECISIONS:
            p.error(f"--ours-engine {prec}: expected one of {', '.join(PRECISIONS)}")
    if args.peer_init.partition(":")[0] == PEER_INIT:
        p.error(f"--peer-init {args.peer_init}: the peer cannot copy itself; use it in --ours-init")
    if args.steps < 1 or args.val_interval < 1 or args.val_batches < 1 or args.micro_batch < 1:
        p.error("--steps, --val-interval, --val-batches and --micro-batch must be >= 1")
    if args.peer_config and args.peer != "ours":
        p.error("--peer-config builds a peer of ours: use it with --peer ours")
    if args.keep_pattern and args.peer != "ours":
        p.error("--keep-pattern: fla's / transformers' Mamba2 blocks have no MLP; use it with --peer ours")
    if args.peer == "hf" and args.family != "mamba2":
        p.error("--peer hf is transformers' Mamba2ForCausalLM (--family mamba2)")
    args.config = args.config or DEFAULT_CONFIG[args.family]
    args.ours_seeds = args.ours_seeds if args.ours_seeds else args.seeds[:1]
    return args


def run_plan(plan, args, report, done, config, peer_config, data_dir: Path, device, val, out: Path,
             flag: StopRequest) -> None:
    """Train each planned run (or keep it from ``done``), writing the JSON after each; a signal stops the plan
    after the run it cut."""
    for role, variant, seed, engine_precision in plan:
        if flag.signal_name:
            return
        name = run_name(args, role, variant, engine_precision)
        if (name, seed) in done:
            print(f"[{name} seed {seed}] finished in {out / 'loss_parity.json'}: kept", flush=True)
            report["runs"].append(done[(name, seed)])
            continue
        if role == "ours":
            model, info = build_ours(config, seed, variant, args)
            if engine_precision:
                info["init"] = f"{variant}+engine:{engine_precision}"
        else:
            model, info = build_peer(args.peer, args.family, peer_config, seed, args)
        label = f"{name} seed {seed}"
        print(f"[{label}] {info.get('class', 'HybridForCausalLM')} {count_params(model):,} params", flush=True)
        rec = engine_run(model, args, data_dir, val, label, engine_precision, flag) if engine_precision else \
            train_run(model, args, data_dir, device, val, label, flag)
        report["runs"].append({"role": role, "name": name, "seed": seed, "params": count_params(model),
                               **{k: v for k, v in info.items() if k != "config"}, **rec})
        del model
        free_memory()
        write(report, out, chart=bool(flag.signal_name))  # the JSON after every run (the chart: at the end)
        if flag.signal_name:
            return


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    if args.replot:
        replot(out)
        return {}
    if args.merge:
        return merge(args.merge, out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if args.peer == "fla" and not cuda:
        raise SystemExit("--peer fla: fla's models run Triton kernels and need a CUDA device; on a CPU use "
                         "--peer ours (or --peer hf for mamba2)")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    data_dir = Path(args.data or DEFAULT_DATA).expanduser()
    if not data_dir.is_absolute():
        data_dir = Path.cwd() / data_dir
    sources = [] if (data_dir / "meta.json").is_file() or args.data else DEFAULT_SOURCES
    ensure_prepared(DataConfig(path=str(data_dir), sources=sources, tokenizer=DEFAULT_TOKENIZER,
                               seq_len=args.seq), progress=False)
    config = resolve_config(args, data_dir)
    peer_config = resolve_config(args, data_dir, args.peer_config, args.peer_model_override) \
        if args.peer_config else config
    val = val_batches(data_dir, args.seq, args.micro_batch, args.val_batches)

    # parameter counts first, on fresh models (the counts do not depend on the random seed)
    probe, _ = build_ours(config, args.ours_seeds[0])
    ours_params = count_params(probe)
    del probe
    peer_probe, peer_info = build_peer(args.peer, args.family, peer_config, args.seeds[0], args)
    peer_params = count_params(peer_probe)
    del peer_probe
    if "note" in peer_info:
        print(f"note: peer {args.peer}: {peer_info['note']}", flush=True)
    ssd_check = check_peer_ssd(args, peer_config, data_dir, device) if args.peer == "hf" else None
    print(f"loss parity {args.family}: ours {ours_params:,} params ({config.hybrid_override_pattern}), "
          f"peer {args.peer} ({peer_info['class']}) {peer_params:,} params", flush=True)
    if ours_params != peer_params and not (args.allow_param_mismatch or args.peer_config):
        raise SystemExit(f"parameter counts differ (ours {ours_params:,}, peer {peer_params:,}): the shapes do not "
                         "match (--allow-param-mismatch trains anyway)")

    report: Dict[str, Any] = {
        "family": args.family, "steps": args.steps, "config": args.config, "model_override": args.model_override,
        "pattern": config.hybrid_override_pattern, "ours_config": config.to_diff_dict(),
        "peer": args.peer, "peer_class": peer_info["class"], "ours_params": ours_params, "peer_params": peer_params,
        "seeds": args.seeds, "ours_seeds_requested": args.ours_seeds, "ours_init": args.ours_init,
        "micro_batch": args.micro_batch, "seq_len": args.seq, "precision": args.precision,
        "optim": {"lr": args.lr, "min_lr": args.min_lr, "warmup_steps": args.warmup, "max_steps": args.steps,
                  "schedule": "linear warmup + cosine (hybridlm.engine.schedule)", "weight_decay": args.weight_decay,
                  "betas": args.betas, "eps": args.eps, "grad_clip": args.grad_clip,
                  "param_groups": "hybridlm.engine.build_param_groups (1-D and _no_weight_decay: no decay)",
                  "optimizer": f"torch.optim.AdamW{' (fused)' if cuda else ''}"},
        "val_interval": args.val_interval, "val_batches": len(val),
        "val_batch_hashes": [batch_hash(b["input_ids"]) for b in val],
        "data": str(data_dir), "device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None,
        **versions(), "command": " ".join(sys.argv), "started": datetime.now(timezone.utc).isoformat(),
        "runs": [],
    }
    if args.peer == "ours":
        report["peer_init"] = args.peer_init
    if args.peer == "hf":
        report.update(peer_ssd=args.peer_ssd, peer_ssd_check=ssd_check, peer_norm=peer_info["norm"])
    if args.peer_config:
        report.update(peer_config_name=args.peer_config, peer_model_override=args.peer_model_override,
                      peer_pattern=peer_config.hybrid_override_pattern)
    # the headline (ours, first variant) and the peer's first seed first: a run cut off by a time
    # limit then still has the comparison; then the engine runs, the other variants, the other peer seeds
    first = args.ours_init[0]
    plan = ([("ours", first, s, None) for s in args.ours_seeds] + [("peer", None, args.seeds[0], None)]
            + [("ours", first, args.ours_seeds[0], prec) for prec in args.ours_engine]
            + [("ours", v, s, None) for v in args.ours_init[1:] for s in args.ours_seeds]
            + [("peer", None, s, None) for s in args.seeds[1:]])
    if args.only:
        plan = [step for step in plan if step[0] == args.only]
    done = resumable_runs(report, out) if args.resume else {}
    flag = STOP.install()  # the signals recorded, asked after each step; given back when the plan ends
    try:
        run_plan(plan, args, report, done, config, peer_config, data_dir, device, val, out, flag)
    finally:
        stopped_by = flag.signal_name
        flag.uninstall()
    if stopped_by:
        raise SystemExit(f"stopped: {stopped_by}; {out / 'loss_parity.json'} has the runs so far (the cut "
                         "one with cut_at); rerun with --resume to run the missing ones")
    report["finished"] = datetime.now(timezone.utc).isoformat()
    write(report, out)
    peer = f"{report['peer_val_loss']:.4f}" if report.get("peer_val_loss") is not None else "n/a"
    ours = f"{report['ours_val_loss']:.4f}" if report.get("ours_val_loss") is not None else "n/a"
    spread = f", peer spread {report['peer_spread']:.4f}" if report.get("peer_spread") is not None else ""
    print(f"val loss after {args.steps} steps: ours {ours}, peer {peer}{spread}; checks {report['checks']}")
    print(f"wrote {out / 'loss_parity.json'} and {out / 'loss_parity.png'}", flush=True)
    c = report["checks"]
    if not (c["same_batches"] and c["same_first_tokens"] and c["same_lrs"]):
        raise SystemExit(2)
    return report


if __name__ == "__main__":
    main()
