"""The distillation stages' subcommands (``upcycle ild | align | kd | dpo --config FILE [section.key=value ...]``),
registered on the ``upcycle`` CLI by :func:`add_subcommands`."""
from __future__ import annotations

import argparse
from typing import Any, Dict

from distill.align import ALIGN_SECTIONS, align_configs, run_align
from distill.dpo_stage import DPO_SECTIONS, dpo_configs, run_dpo
from distill.kd import KD_SECTIONS, kd_configs, run_kd
from distill.stage import STAGE_SECTIONS, ild_configs, run_ild
from hybridlm.config.loader import load_config


def cmd_ild(args) -> Dict[str, Any]:
    return run_ild(ild_configs(load_config(args.config, args.overrides, sections=STAGE_SECTIONS)))


def cmd_align(args) -> Dict[str, Any]:
    return run_align(align_configs(load_config(args.config, args.overrides, sections=ALIGN_SECTIONS)))


def cmd_kd(args) -> Dict[str, Any]:
    return run_kd(kd_configs(load_config(args.config, args.overrides, sections=KD_SECTIONS)))


def cmd_dpo(args) -> Dict[str, Any]:
    return run_dpo(dpo_configs(load_config(args.config, args.overrides, sections=DPO_SECTIONS)))


def add_stage_parser(subparsers, name: str, help: str, sections: tuple, fn) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help)
    p.add_argument("--config", required=True, help=f"stage YAML: {', '.join(sections)} sections")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. student.path=... optim.lr=1e-4")
    p.set_defaults(fn=fn)
    return p


def add_subcommands(subparsers) -> None:
    """Register ``ild``, ``align``, ``kd`` and ``dpo`` on an argparse subparsers object."""
    add_stage_parser(subparsers, "ild", "Intermediate Layer Distillation of a student (teacher-forced, per layer)",
                     STAGE_SECTIONS, cmd_ild)
    add_stage_parser(subparsers, "align", "Hidden-state alignment of a composed hybrid: its residual stream matched "
                     "to the teacher's layer by layer, only the mixers train (MOHAWK / Llamba)", ALIGN_SECTIONS,
                     cmd_align)
    add_stage_parser(subparsers, "kd", "KD-SFT: the student learns the frozen teacher's token distribution "
                     "on chat data (all student parameters train; optim.group_lr: a learning rate per group)", KD_SECTIONS, cmd_kd)
    add_stage_parser(subparsers, "dpo", "DPO of a (KD-SFT) student against a frozen copy of itself",
                     DPO_SECTIONS, cmd_dpo)
