"""Command line of the pre-training stage."""
from __future__ import annotations

import argparse
from typing import List, Optional

from hybridlm.config.loader import load_config
from hybridlm.config.structured import build_dataclass
from hybridlm.data import DataConfig, load_tokenizer
from hybridlm.engine import OptimConfig
from hybridlm.model.configuration import HybridConfig
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.model.summary import model_summary
from hybridlm.training import RunConfig
from hybridlm.training.exits import run_cli
from hybridlm.training.preempt import STOP
from hybridlm.utils.atomic import json_text
from pretrain.train import PRETRAIN_SECTIONS, run_pretraining


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pretrain.py", description=__doc__)
    p.add_argument("--config", required=True, help="experiment YAML (or a bare model YAML)")
    p.add_argument("--dry-run", action="store_true",
                   help="check every section, build the model on the meta device, print one JSON line (params, "
                        "layer plan) and exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. optim.lr=3e-4 model.mixer=kda")
    return p.parse_args(argv)


def dry_run(sections) -> dict:
    """The model's summary, built on the meta device; the data / optim / run sections that are given are checked
    too (keys and values, not the data on disk; a bare model file has none)."""
    for name, cls in (("data", DataConfig), ("optim", OptimConfig), ("run", RunConfig), ("runtime", RuntimeSettings)):
        if sections.get(name):
            build_dataclass(cls, sections[name], name)
    model = dict(sections["model"])
    if model.get("vocab_size", "auto") == "auto":  # the tokenizer decides; load it, nothing else
        model["vocab_size"] = len(load_tokenizer(sections["data"].get("tokenizer", "asset:llama3.2")))
    return model_summary(HybridConfig.from_user_dict(model))


def main(argv: Optional[List[str]] = None) -> int:
    STOP.install()  # first: from here to the exit a SIGTERM / SIGUSR1 is a request (exit 143, `stopped:`)
    args = parse_args(argv)

    def run() -> None:
        sections = load_config(args.config, args.overrides, sections=PRETRAIN_SECTIONS)
        if args.dry_run:
            print(json_text(dry_run(sections)))
            return
        run_pretraining(sections, config_path=args.config)

    return run_cli(run)
