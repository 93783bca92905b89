"""The training stages, each declared once: a :class:`StageSpec` in :data:`STAGES`.

A stage's declaration names its schema (``configs``: the route section or a single-stage config built into
dataclasses, once), its runner, its ``upcycle`` subcommand, the tokens one of its optimizer steps holds at most
(the route's progress line), and its plan hook (bytes per rank and FLOPs, ``upcycle plan``). The route
(upcycle/route.py), the plan (upcycle/plan.py), the progress line (upcycle/route_progress.py) and the CLI
(upcycle/cli.py) read this table and nothing else about a training stage.

Where the route runs a stage: one of ``students="pure"`` (ILD) trains each of init's two students before SMART
(runs ``<name>_mla`` and ``<name>_<linear mixer>``); the others train the hybrid after compose, in the order of
:data:`STAGES`, each from the previous one's ``final/`` (the first from the composed hybrid). An ``optional``
stage runs when the route has a non-empty section of its name. ``upcycle run``'s fixed steps (init, SMART,
compose, the teacher's samples before the first stage that ``reads_samples``, the report) are upcycle/route.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from distill.align import ALIGN_SECTIONS, align_configs, run_align
from distill.dpo_stage import DPO_SECTIONS, dpo_configs, run_dpo
from distill.kd import KD_SECTIONS, kd_configs, run_kd
from distill.stage import STAGE_SECTIONS, ild_configs, run_ild
from hybridlm.config.errors import ConfigError
from hybridlm.config.loader import load_config
from hybridlm.data.sft import SFTDataConfig
from upcycle.footprint import BF16, FP32, PlanInputs, StagePlan, trained_bytes

Configs = Dict[str, Any]  # a stage's sections built by its schema: {"data": DataConfig, "optim": OptimConfig, ...}


def step_tokens(configs: Configs) -> int:
    """Tokens of one optimizer step at most: global batch x the data's ``max_length`` (padded examples) or
    ``seq_len`` (packed windows)."""
    data = configs["data"]
    return configs["optim"].global_batch_size * (getattr(data, "max_length", None) or data.seq_len)


@dataclasses.dataclass(frozen=True)
class StageSpec:
    name: str  # the route section, the output folder, the key in route.json and the progress line
    configs: Callable[[Dict[str, Any], str], Configs]  # the one schema: (raw sections, error prefix) -> built
    run: Callable[[Configs], Dict[str, Any]]  # trains and exports; returns the stage's record (final/stage.json)
    plan: Callable[[str, PlanInputs, Configs, int], List[StagePlan]]  # (name, models, built, ranks) -> its runs
    note: str  # the plan's note on the stage: what trains, how its sequences are counted
    tokens_per_step: Callable[[Configs], int] = step_tokens
    students: str = "hybrid"  # "pure": each of init's two students, before SMART; "hybrid": after compose
    teacher: bool = True  # the route hands it ``teacher.path``
    optional: bool = True  # the route runs it only with a non-empty section
    reads_samples: bool = False  # the teacher's samples (a ``sample:`` section) are written before it
    command: Optional[str] = None  # its ``upcycle`` subcommand (a single-stage config with ``sections``)
    help: str = ""
    sections: Tuple[str, ...] = ()


STAGES: Dict[str, StageSpec] = {}


def register_stage(spec: StageSpec, before: Optional[str] = None) -> StageSpec:
    """Add ``spec`` to :data:`STAGES`, last or ``before`` a registered stage (its place in the route)."""
    if spec.name in STAGES:
        raise ValueError(f"stage {spec.name!r} is registered already")
    if spec.students not in ("pure", "hybrid"):
        raise ValueError(f"stage {spec.name!r}: students must be 'pure' or 'hybrid', got {spec.students!r}")
    if before is None:
        STAGES[spec.name] = spec
        return spec
    items = list(STAGES.items())
    at = [name for name, _ in items].index(before)
    STAGES.clear()
    STAGES.update(items[:at] + [(spec.name, spec)] + items[at:])
    return spec


def pure_stages() -> List[StageSpec]:
    return [s for s in STAGES.values() if s.students == "pure"]


def hybrid_stages() -> List[StageSpec]:
    return [s for s in STAGES.values() if s.students == "hybrid"]


def hybrid_steps(specs: List[StageSpec], samples: bool) -> List[str]:
    """The route's steps after compose: the names of ``specs`` in order, with the teacher's ``sample`` step (when
    ``samples``) right before the first stage that reads them."""
    names = [spec.name for spec in specs]
    first_reader = next((i for i, spec in enumerate(specs) if spec.reads_samples), None) if samples else None
    return names if first_reader is None else [*names[:first_reader], "sample", *names[first_reader:]]


# ------------------------------------------------------------------------------------------- route
def stage_sections(section: Dict[str, Any], where: str, **fixed) -> Dict[str, Any]:
    """A route section's own sections with the route's ``fixed`` values (``student__path=...``: section
    ``student``, key ``path``) filled in."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(section).__name__}")
    out = {k: dict(v or {}) for k, v in section.items()}
    for key, value in fixed.items():
        name, _, field = key.partition("__")
        out.setdefault(name, {})[field] = value
    return out


def route_stage_sections(cfg: Dict[str, Any], out: Path, teacher: str) -> Dict[str, Dict[str, Any]]:
    """The sections of every training stage the route ``cfg`` runs, with the teacher, the student each trains
    and its output directory under ``out`` filled in (a pure stage: init's MLA student, its first run's)."""
    stages: Dict[str, Dict[str, Any]] = {}
    previous = out / "hybrid"
    for spec in STAGES.values():
        section = cfg.get(spec.name)
        if spec.optional and not section:
            continue
        teacher_path = {"teacher__path": teacher} if spec.teacher else {}
        if spec.students == "pure":
            student, output = out / "init" / "mla_student", out / f"{spec.name}_mla"
        else:
            student, output = previous, out / spec.name
            previous = output / "final"
        stages[spec.name] = stage_sections(section or {}, spec.name, **teacher_path, student__path=str(student),
                                           run__output_dir=str(output))
    return stages


def check_route(stages: Dict[str, Dict[str, Any]]) -> Dict[str, Configs]:
    """Every training section of the route built through its stage's own schema, once, before the first stage
    starts: a typo in ``dpo.optim`` must not surface after init, both ILD runs, SMART and KD have finished."""
    return {name: STAGES[name].configs(sections, f"{name}.") for name, sections in stages.items()}


# ------------------------------------------------------------------------------------------- CLI
def add_stage_parser(subparsers, name: str, help: str, sections: tuple, fn) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help)
    p.add_argument("--config", required=True, help=f"stage YAML: {', '.join(sections)} sections")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. student.path=... optim.lr=1e-4")
    p.set_defaults(fn=fn)
    return p


def run_command(spec: StageSpec, args) -> Dict[str, Any]:
    """``upcycle <command> --config FILE [section.key=value ...]``: the config built once, then the stage."""
    return spec.run(spec.configs(load_config(args.config, args.overrides, sections=spec.sections), ""))


def add_stage_commands(subparsers) -> None:
    """A subcommand for every stage of :data:`STAGES` that names one, in their order."""
    for spec in STAGES.values():
        if spec.command:
            add_stage_parser(subparsers, spec.command, spec.help, spec.sections, partial(run_command, spec))


# ------------------------------------------------------------------------------------------ plan hooks
def batch(configs: Configs, seq_len: int, sequences: int = 1) -> Tuple[int, bool, int]:
    """(micro batch, activation checkpointing, tokens of the whole stage) of a stage whose examples are
    ``sequences`` sequences of ``seq_len`` tokens."""
    optim = configs["optim"]
    return (optim.micro_batch_size, optim.activation_checkpointing,
            optim.max_steps * optim.global_batch_size * sequences * seq_len)


def plan_ild(name: str, p: PlanInputs, configs: Configs, gpus: int) -> List[StagePlan]:
    s = configs["data"].seq_len
    b, ckpt, tokens = batch(configs, s)
    out = []
    for kind, st in p.students.items():
        n = st.params
        by = {"teacher weights (bf16)": BF16 * p.teacher_params, **trained_bytes(n["total"], n["layers"], gpus),
              "activations": st.activations(b * s, ckpt),
              "teacher trace / logits": BF16 * 3 * p.shapes["L"] * b * s * p.shapes["d"]}
        fl = (6.0 * n["layers"] + (2.0 if ckpt else 0.0) * n["layers"] + st.mixer_flops(s) * 3
              + p.teacher_flops(s))
        out.append(StagePlan(f"{name}_{kind}", gpus, b, s, tokens, by, fl * tokens, STAGES[name].note))
    return out


def plan_align(name: str, p: PlanInputs, configs: Configs, gpus: int) -> List[StagePlan]:
    s = configs["data"].seq_len
    b, ckpt, tokens = batch(configs, s)
    h = p.hybrid
    hp, mixers = h.params["total"], h.params["mixers"]
    by = {"teacher weights (bf16)": BF16 * p.teacher_params, **trained_bytes(hp, mixers, gpus),
          "activations": h.activations(b * s, ckpt),
          "teacher trace / logits": BF16 * 3 * p.shapes["L"] * b * s * p.shapes["d"]}
    # the backward passes through every layer (input gradients) but makes weight gradients for the mixers only
    layers_mm = h.params["layers"]
    fl = (4.0 * layers_mm + 2.0 * mixers + (2.0 if ckpt else 0.0) * layers_mm + 3 * h.mixer_flops(s)
          + p.teacher_flops(s))
    return [StagePlan(name, gpus, b, s, tokens, by, fl * tokens, STAGES[name].note)]


CHAT_PLAN_LENGTH = 1024  # tokens the plan counts a chat (max_length, padded) KD sequence at: it has no seq_len


def kd_seq_len(configs: Configs) -> int:
    """The sequence length the plan counts for a KD stage: its packed windows' ``seq_len``."""
    data = configs["data"]
    return CHAT_PLAN_LENGTH if isinstance(data, SFTDataConfig) else data.seq_len


def plan_kd(name: str, p: PlanInputs, configs: Configs, gpus: int) -> List[StagePlan]:
    s = kd_seq_len(configs)
    b, ckpt, tokens = batch(configs, s)
    h = p.hybrid
    hp = h.params["total"]
    hp_mm = hp - p.lookup
    by = {"teacher weights (bf16)": BF16 * p.teacher_params, **trained_bytes(hp, hp, gpus),
          "activations": h.activations(b * s, ckpt) + BF16 * b * s * p.shapes["d"],
          "teacher trace / logits": 3 * FP32 * min(configs["kd"].chunk_tokens, b * s) * p.shapes["vocab"]}
    fl = (6.0 * hp_mm + (2.0 if ckpt else 0.0) * hp_mm + 3 * h.mixer_flops(s) + p.teacher_flops(s))
    return [StagePlan(name, gpus, b, s, tokens, by, fl * tokens, STAGES[name].note)]


def plan_dpo(name: str, p: PlanInputs, configs: Configs, gpus: int) -> List[StagePlan]:
    s = configs["data"].max_length
    b, ckpt, tokens = batch(configs, s, sequences=2)  # chosen and rejected
    seqs = 2 * b
    h = p.hybrid
    hp = h.params["total"]
    hp_mm = hp - p.lookup
    by = {"reference weights (bf16)": BF16 * hp, **trained_bytes(hp, hp, gpus),
          "activations": h.activations(seqs * s, ckpt),
          "teacher trace / logits": (BF16 + FP32 + FP32) * seqs * s * p.shapes["vocab"]}
    fl = (6.0 * hp_mm + (2.0 if ckpt else 0.0) * hp_mm + 3 * h.mixer_flops(s) + 2.0 * hp_mm)
    return [StagePlan(name, gpus, b, s, tokens, by, fl * tokens, STAGES[name].note)]


# ------------------------------------------------------------------------------------------- the stages
register_stage(StageSpec(
    "ild", ild_configs, run_ild, plan_ild, "decoder layers train; embeddings and head frozen", students="pure",
    optional=False, command="ild", sections=STAGE_SECTIONS,
    help="Intermediate Layer Distillation of a student (teacher-forced, per layer)"))
register_stage(StageSpec(
    "align", align_configs, run_align, plan_align, "the mixers train; the stream runs end to end", command="align",
    sections=ALIGN_SECTIONS,
    help="Hidden-state alignment of a composed hybrid: its residual stream matched to the teacher's layer by "
         "layer, only the mixers train (MOHAWK / Llamba)"))
register_stage(StageSpec(
    "kd", kd_configs, run_kd, plan_kd, "every parameter trains", optional=False, reads_samples=True, command="kd",
    sections=KD_SECTIONS,
    help="KD-SFT: the student learns the frozen teacher's token distribution on chat data (all student "
         "parameters train; optim.group_lr: a learning rate per group)"))
register_stage(StageSpec(  # KD again at a longer sequence length, usually on windows inside one document
    "long_context", kd_configs, run_kd, plan_kd, "KD again at its longer sequence length"))
register_stage(StageSpec(
    "dpo", dpo_configs, run_dpo, plan_dpo, "b pairs = 2b sequences padded to max_length",
    tokens_per_step=lambda configs: 2 * step_tokens(configs), teacher=False, optional=False, command="dpo",
    sections=DPO_SECTIONS, help="DPO of a (KD-SFT) student against a frozen copy of itself"))
