"""``upcycle plan``: bytes per rank and GPU time of every stage of a route, from the teacher's config.json alone.

    upcycle plan --config configs/upcycle/llama3.2-1b_8mla_route.yaml --gpus 8 [--teacher configs/llama/llama-3.2-1b.json] \
        [init.linear_mixer=gdn ...]

No weights are read: the teacher and the students are built on PyTorch's ``meta`` device, so every parameter count
is the real model's. Per rank and stage the plan counts:

* **teacher**: bf16 weights, frozen (no gradient, no optimizer state), a whole copy on every rank.
* **student**: bf16 weights of every parameter; for the trainable ones (ILD: the decoder layers; KD and DPO: all)
  a bf16 gradient (2 B), DeepSpeed's fp32 gradient accumulator (``BF16_Optimizer`` keeps it whole on every rank:
  4 B), and, sharded by ZeRO-1 over the N ranks, the fp32 master weights (4 B / N) and AdamW's two moments
  (8 B / N). Frozen student parameters (ILD: embeddings, final norm, LM head) hold only their bf16 weights.
* **reference** (DPO): the frozen bf16 copy of the KD student.
* **activations** (bf16, per micro-batch of b sequences of s tokens; :func:`activation_widths`): what the
  backward keeps of every sublayer, in values per token: a pre-norm's input and output (2d); a SwiGLU MLP's gate
  and up outputs and their product (3f); a mixer's own widths from its registry entry
  (:class:`hybridlm.model.registry.MixerCosts` ``activations``; e.g. MLA's latents, queries, decompressed keys and
  values, attention output and log-sum-exp, a linear mixer's projections, conv outputs, recurrence and gated-norm
  outputs and fp32 chunk states; each mixer's file states its own). With ``activation_checkpointing`` only
  each block's input is kept, plus one block's activations while it is recomputed. ILD also keeps the teacher's
  trace (input, mixer output and layer output of every layer: 3 L s b d values). Logits: KD computes them in
  chunks (``kd.chunk_tokens`` tokens: ~3 x chunk x vocab fp32 for the student and teacher together); DPO keeps
  the policy's whole bf16 logits, their fp32 copy and its fp32 gradient (10 B per logit) for the chosen and the
  rejected sequence of every pair, padded to ``max_length``.
* Not counted: the CUDA context and allocator fragmentation (typically 1-3 GiB), DeepSpeed's communication
  buckets, transient copies inside kernels, and the temporaries of a frozen model's no-grad forward.

Time: 6 FLOPs per token and trainable-path parameter (forward 2, backward 4), 2 per frozen parameter the
forward runs through (teacher, reference, ILD's frozen embeddings), +2 per student parameter with activation
checkpointing, plus each mixer's forward FLOPs beyond its weights from its registry entry (``MixerCosts.flops``:
causal attention's ``n_h x s x (qk + v)``, a chunked recurrence's intra-chunk and state terms;
hybridlm/model/layers/mixing_flops.py), 3x that trained, and the teacher's causal attention by the same formula;
divided by N x ``peak_tflops`` x ``mfu``. Beside the stages the plan lists the hybrid's mixers with their
registry figures per layer: forward FLOPs per token, values cached per token, fixed-size state per sequence and
activation widths.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from hybridlm.config.errors import ConfigError
from hybridlm.config.loader import deep_merge, parse_override
from hybridlm.config.structured import build_dataclass
from hybridlm.kv_report import load_teacher_config
from hybridlm.model.registry import costs_of
from hybridlm.teacher import resolve_teacher
from smart_select.stage import SmartConfig
from upcycle.footprint import (BF16, FP32, GIB, StagePlan, activation_bytes, activation_widths,  # noqa: F401
                               forward_flops_per_token, plan_inputs, student_kinds, trained_bytes)
from upcycle.init_students import InitConfig
from upcycle.stages import check_route, hybrid_stages, kd_seq_len, pure_stages, route_stage_sections

# ------------------------------------------------------------------------------------------- mixers
@dataclasses.dataclass
class MixerPlan:
    """One mixer kind of the hybrid, per layer, from its registry entry (:class:`MixerCosts`)."""
    kind: str
    layers: int            # layers of the hybrid that use it
    seq_len: int           # the context its FLOPs are counted at
    flops_per_token: float  # forward, beyond the weight multiplies
    cache_per_token: int    # values cached per token while generating
    state_per_sequence: int  # values of the fixed-size generation state
    activations_per_token: Optional[float]  # values the backward keeps (pre-norm not included)


def mixer_plans(cfg, layer_kinds: Sequence[str], seq_len: int) -> List[MixerPlan]:
    """One :class:`MixerPlan` per mixer kind of ``layer_kinds``, in order of first use."""
    out: Dict[str, MixerPlan] = {}
    for kind in layer_kinds:
        if kind in out:
            out[kind].layers += 1
            continue
        a, c = cfg.mixer_args(kind), costs_of(kind)
        out[kind] = MixerPlan(kind, 1, seq_len, c.flops(a, seq_len), c.cache_per_token(a), c.state_per_sequence(a),
                              None if c.activations is None else c.activations(a))
    return list(out.values())


# ------------------------------------------------------------------------------------------- stages
@dataclasses.dataclass
class RoutePlan:
    stages: List[StagePlan]
    mixers: List[MixerPlan]  # of the composed hybrid, at the KD sequence length


def check_modelled(optim, where: str) -> None:
    if optim.precision != "bf16" or optim.zero_stage != 1:
        raise ConfigError(f"{where}.optim: the plan models precision bf16 with zero_stage 1, got "
                          f"{optim.precision} / {optim.zero_stage}")


def plan_route(cfg: Dict[str, Any], teacher_cfg, gpus: int) -> RoutePlan:
    """One :class:`StagePlan` per stage of the route config ``cfg`` on ``gpus`` ranks, and the hybrid's mixers.
    The training stages' sections are built by the route's own schemas (:func:`upcycle.stages.check_route`)
    and planned by their declarations' hooks (:class:`upcycle.stages.StageSpec` ``plan``)."""
    if gpus < 1:
        raise ConfigError(f"--gpus: expected at least 1, got {gpus}")
    init = build_dataclass(InitConfig, cfg.get("init") or {}, "init")
    smart = build_dataclass(SmartConfig, cfg.get("smart") or {}, "smart")
    n_mla = len(smart.mla_layers) if smart.mla_layers else int(smart.n_mla or 0)
    if not n_mla:
        raise ConfigError("smart: the plan needs n_mla or mla_layers (how many layers the hybrid keeps as MLA)")
    p = plan_inputs(teacher_cfg, init, n_mla)
    out = Path(str(cfg.get("output_dir") or "."))  # the route's paths: the plan reads no file
    built = check_route(route_stage_sections(cfg, out, str(cfg.get("teacher") or "asset:smollm2")))
    T, L, V = p.teacher_params, p.shapes["L"], p.shapes["vocab"]
    plans: List[StagePlan] = []

    def stage(spec) -> None:
        if spec.name in built:
            check_modelled(built[spec.name]["optim"], spec.name)
            plans.extend(spec.plan(spec.name, p, built[spec.name], gpus))

    # init: rank 0, fp32 teacher and one fp32 student at a time (the calibration runs both on its GPU)
    biggest = max(st.params["total"] for st in p.students.values())
    plans.append(StagePlan("init", 1, 1, init.calib_seq_len, init.calib_tokens,
                           {"teacher weights (fp32)": FP32 * T, "student weights (fp32)": FP32 * biggest},
                           2.0 * (T + biggest) * init.calib_tokens,
                           "rank 0 only; calibration forwards, no optimizer"))
    for spec in pure_stages():
        stage(spec)

    s = built["ild"]["data"].seq_len
    b = smart.batch_size
    tokens = smart.batches * b * s
    lin_p = p.students[init.linear_mixer].params["total"]
    by = {"teacher weights (bf16)": BF16 * T,
          "student weights (bf16)": BF16 * sum(st.params["total"] for st in p.students.values()),
          "teacher trace / logits": 3 * FP32 * b * s * V}
    plans.append(StagePlan("smart", 1, b, s, tokens, by,
                           2.0 * (p.teacher_matmul + (L + 1) * (lin_p - p.lookup)) * tokens,
                           f"rank 0 only; forward only: the teacher and {L + 1} hybrids"))
    for spec in hybrid_stages():
        stage(spec)
    return RoutePlan(plans, mixer_plans(p.hybrid.config, p.hybrid.layer_kinds, kd_seq_len(built["kd"])))


# -------------------------------------------------------------------------------------------- output
COLUMNS = ("teacher weights (bf16)", "reference weights (bf16)", "teacher weights (fp32)", "student weights (bf16)",
           "student weights (fp32)", "gradients (bf16 + fp32 accumulator)", "master + Adam (fp32, ZeRO-1)",
           "activations", "teacher trace / logits")
SHORT = {"teacher weights (bf16)": "teacher", "reference weights (bf16)": "teacher",
         "teacher weights (fp32)": "teacher", "student weights (bf16)": "weights", "student weights (fp32)": "weights",
         "gradients (bf16 + fp32 accumulator)": "grads", "master + Adam (fp32, ZeRO-1)": "optim",
         "activations": "activ.", "teacher trace / logits": "trace/logits"}


def plan_rows(plans: Sequence[StagePlan], gpus: int, peak_tflops: float, mfu: float) -> List[Dict[str, Any]]:
    rows = []
    for p in plans:
        gb = {SHORT[k]: 0.0 for k in COLUMNS}
        for k, v in p.bytes.items():
            gb[SHORT[k]] += v / GIB
        hours = p.flops / (p.ranks * peak_tflops * 1e12 * mfu) / 3600
        rows.append({"stage": p.name, "ranks": p.ranks, "micro_batch": p.micro_batch, "seq_len": p.seq_len,
                     "tokens": p.tokens, **{k: round(v, 2) for k, v in gb.items()},
                     "total_gib": round(p.total / GIB, 2), "gpu_hours": round(hours * p.ranks, 2),
                     "wall_hours": round(hours, 2), "note": p.note})
    return rows


def _count(n: float) -> str:
    """``1.4B``, ``8.39M``, ``32.8k``, ``256``."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"


def format_plan(rows: Sequence[Dict[str, Any]], title: str, gpu_mem_gib: float) -> str:
    heads = ["stage", "ranks", "b x s", "tokens", "teacher", "weights", "grads", "optim", "activ.", "trace/logits",
             "total GiB", "fits", "wall h"]
    body = [[r["stage"], str(r["ranks"]), f"{r['micro_batch']} x {r['seq_len']}", _count(r["tokens"]),
             *(f"{r[k]:.2f}" for k in ("teacher", "weights", "grads", "optim", "activ.", "trace/logits",
                                       "total_gib")),
             "yes" if r["total_gib"] <= gpu_mem_gib else "NO", f"{r['wall_hours']:.2f}"] for r in rows]
    w = [max(len(x[i]) for x in [heads] + body) for i in range(len(heads))]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(cells)) + " |"
    lines = [title, fmt(heads), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [fmt(b) for b in body]
    return "\n".join(lines)


def load_route(path, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """The route YAML ``path`` with ``section.key=value`` overrides (``init.linear_mixer=gdn``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: expected a mapping of route sections")
    for item in overrides:
        cfg = deep_merge(cfg, parse_override(item))
    return cfg


def teacher_config_for(cfg: Dict[str, Any], teacher: Optional[str]):
    """``--teacher`` (a config.json or model directory) or else the route's ``teacher:`` directory."""
    spec = teacher or cfg.get("teacher")
    if not spec:
        raise ConfigError("--teacher: the route names no teacher; give its config.json or model directory")
    if str(spec).startswith("asset:"):
        spec = resolve_teacher(spec)
    if not Path(str(spec)).expanduser().exists():
        raise ConfigError(f"teacher {spec!r}: not found; give --teacher a config.json (configs/llama/*.json) or a "
                          f"model directory")
    return load_teacher_config(spec)


def format_mixers(mixers: Sequence[MixerPlan]) -> str:
    heads = ["mixer", "layers", "fwd FLOP/token", "cache values/token", "state values/seq", "activ. values/token"]
    body = [[m.kind, str(m.layers), _count(m.flops_per_token), f"{m.cache_per_token:,}",
             f"{m.state_per_sequence:,}", "-" if m.activations_per_token is None else f"{m.activations_per_token:,.0f}"]
            for m in mixers]
    w = [max(len(x[i]) for x in [heads] + body) for i in range(len(heads))]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(cells)) + " |"
    title = (f"hybrid mixers, per layer at {mixers[0].seq_len} tokens (registry costs: forward FLOPs beyond the "
             f"weights, generation cache and state, activations the backward keeps)") if mixers else "hybrid mixers"
    return "\n".join([title, fmt(heads), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [fmt(b) for b in body])


def cmd_plan(args) -> Dict[str, Any]:
    cfg = load_route(args.config, args.overrides)
    teacher_cfg = teacher_config_for(cfg, args.teacher)
    plan = plan_route(cfg, teacher_cfg, args.gpus)
    rows = plan_rows(plan.stages, args.gpus, args.peak_tflops, args.mfu)
    title = (f"{args.config}: {args.gpus} ranks, per-rank GiB (bf16 ZeRO-1), time at {args.mfu:.0%} of "
             f"{args.peak_tflops:g} TFLOP/s")
    print(format_plan(rows, title, args.gpu_mem_gib))
    print()
    print(format_mixers(plan.mixers))
    return {"config": str(args.config), "overrides": list(args.overrides), "gpus": args.gpus, "stages": rows,
            "mixers": [dataclasses.asdict(m) for m in plan.mixers]}


def add_subcommand(sub) -> None:
    pl = sub.add_parser("plan", help="memory per rank and GPU time of every stage of a route, before running it")
    pl.add_argument("--config", required=True, help="route YAML (configs/upcycle/*.yaml)")
    pl.add_argument("--gpus", type=int, default=8, help="ranks the training stages run on")
    pl.add_argument("--teacher", default=None,
                    help="the teacher's config.json or model directory (default: the route's teacher)")
    pl.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory of one GPU, for the fits column")
    pl.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H100 SXM: 989)")
    pl.add_argument("--mfu", type=float, default=0.3, help="assumed fraction of the peak the stages reach")
    pl.add_argument("overrides", nargs="*", help="section.key=value overrides of the route, e.g. init.linear_mixer=gdn")
    pl.set_defaults(fn=cmd_plan)
