"""``upcycle``: turn a pretrained Llama into MLA / linear-mixer students and report KV-cache sizes.

    upcycle init --teacher asset:smollm2 --out runs/upcycle/init [--kv-lora-rank 128 --qk-rope-head-dim 32 ...]
    upcycle kv-report --teacher configs/llama/llama-3.2-1b.json --mla-layers 0,5,10,14 --kv-lora-rank 128 \\
        --qk-rope-head-dim 32 [--linear-mixer gdn]
    upcycle plan --config configs/upcycle/llama3.2-1b_8mla_route.yaml --gpus 8 --teacher configs/llama/llama-3.2-1b.json \\
        [init.linear_mixer=gdn]

Every stage reads and writes transformers-format directories; outputs appear atomically.
"""
from __future__ import annotations

import signal

if __name__ == "__main__":  # `python -m upcycle.cli`: the stop signals wait, blocked, until main() owns them
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1))

import argparse
import dataclasses
import json
from pathlib import Path
from typing import List, Optional

from distill.teacher_samples import add_subcommand as add_sample
from hybridlm.config.errors import ConfigError
from hybridlm.config.layers import parse_layers
from hybridlm.model.configuration import REMOTE_CODE_HELP
from hybridlm.config.loader import load_config
from hybridlm.kv_report import ATTENTION_KIND, format_kv_report, kv_report, load_teacher_config
from hybridlm.model.registry import linear_kinds
from hybridlm.teacher import resolve_teacher
from hybridlm.training.exits import run_cli
from hybridlm.training.preempt import STOP
from hybridlm.utils.flags import RenamedFlag
from smart_select.stage import add_subcommand as add_smart
from upcycle.compose import add_subcommand as add_compose
from upcycle.init_linear import upcycling_kinds
from upcycle.init_students import InitConfig, init_students  # flags default to the route's init section
from upcycle.plan import add_subcommand as add_plan
from upcycle.route import route_sections, run_route
from upcycle.route_report import route_report
from upcycle.stages import add_stage_commands
from upcycle.student import ROPE_INITS, student_config


LEVERS_HELP = """\
the published distillation levers, each an option of the route YAML (docs/upcycling.md, "Distillation levers";
configs/upcycle/smollm2_levers_cpu.yaml turns every one on):
  kd.optim.group_lr, dpo.optim.group_lr
      a learning rate per parameter group: inherited (from the teacher), mixer (linear mixers), latent (MLA);
      0 freezes a group (fla-org/hybrid-distillation, arXiv 2512.20569: inherited ~7e-6, mixers ~1e-4)
  align: {data, align: {loss: mse|cosine, stream: student|teacher, train}, optim, run}
      a stage between compose and KD: the hybrid's residual stream matched to the teacher's layer by layer,
      only the mixers training (MOHAWK / Llamba, arXiv 2502.14458); no section, no stage
  smart.method: kl_restore
      the n_mla layers whose restoring to attention lowers the KL most, clustered or not
      (fla-org/hybrid-distillation), instead of SMART's spaced choice (smart, the default)"""


def cmd_kv_report(args) -> dict:
    source = args.teacher if str(args.teacher).endswith(".json") else resolve_teacher(args.teacher)
    teacher_cfg = load_teacher_config(source)
    layers = parse_layers(args.mla_layers, "--mla-layers")
    # the students `upcycle init` builds: their mixers' settings give the linear layers' state sizes
    student = student_config(teacher_cfg, [args.linear_mixer] * teacher_cfg.num_hidden_layers,
                             kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.qk_rope_head_dim)
    report = kv_report(teacher_cfg, layers, args.kv_lora_rank, args.qk_rope_head_dim, linear_mixer=args.linear_mixer,
                       mixer_args={k: student.mixer_args(k) for k in (ATTENTION_KIND, args.linear_mixer)})
    print(format_kv_report(report))
    return report


def cmd_init(args) -> dict:
    cfg = InitConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(InitConfig)})
    return init_students(cfg, args.teacher, args.out, overwrite=args.overwrite)


def cmd_run(args) -> dict:
    return run_route(load_config(args.config, args.overrides, sections=route_sections()))


def cmd_report(args) -> dict:
    data = args.data
    if data is None:  # the packed data ILD trained on, as the route recorded it
        cfg_file = Path(args.route_dir) / "route_config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: missing (expected a directory written by `upcycle run`)")
        data = ((json.loads(cfg_file.read_text()).get("ild") or {}).get("data") or {}).get("path")
        if not data:
            raise ConfigError("--data: the route config names no ild.data.path; give the packed data to hold out")
    cfg_file = Path(args.route_dir) / "route_config.json"
    saved = (json.loads(cfg_file.read_text()).get("report") or {}) if cfg_file.is_file() else {}
    sources = args.heldout_sources if args.heldout_sources is not None else saved.get("heldout_sources", ())
    cloze = args.cloze_items if args.cloze_items is not None else saved.get("cloze_items", 0)
    gen = {key: getattr(args, key) if getattr(args, key) is not None else saved[key]
           for key in ("generation_prompts", "generation_tokens") if getattr(args, key) is not None or key in saved}
    ruler = {key: saved[key] for key in ("ruler_lengths", "ruler_items", "ruler_tasks") if key in saved}
    if args.ruler_lengths is not None:
        ruler["ruler_lengths"] = args.ruler_lengths
    if args.ruler_items is not None:
        ruler["ruler_items"] = args.ruler_items
    return route_report(args.route_dir, data, seq_len=args.seq_len, max_tokens=args.tokens, heldout_sources=sources,
                        cloze_items=cloze, **gen, **ruler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="upcycle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the deepspeed launcher passes --local_rank before the subcommand; ranks read LOCAL_RANK from the environment
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="build the pure-MLA (SVD) and pure linear-mixer (MambaInLlama) students")
    i.add_argument("--teacher", required=True, help="Llama directory, .gguf file, or asset:smollm2")
    i.add_argument("--out", required=True)
    i.add_argument("--q-lora-rank", type=int, default=InitConfig.q_lora_rank,
                   help="q latent rank (default: full, n_heads * head_dim)")
    i.add_argument("--kv-lora-rank", type=int, default=InitConfig.kv_lora_rank, help="kv latent rank")
    i.add_argument("--energy", type=float, default=InitConfig.energy,
                   help="choose ranks by kept sigma^2 energy instead (0-1]")
    i.add_argument("--qk-rope-head-dim", type=int, default=InitConfig.qk_rope_head_dim,
                   help="decoupled RoPE dims per head")
    i.add_argument("--rope-init", choices=ROPE_INITS, default=InitConfig.rope_init)
    i.add_argument("--linear-mixer", choices=upcycling_kinds(), default=InitConfig.linear_mixer)
    i.add_argument("--seed", type=int, default=InitConfig.seed, help="seed of the default-initialised parameters (z, dt, conv)")
    i.add_argument("--calib-sources", nargs="+", default=InitConfig().calib_sources,
                   help="text (asset:<name>, .txt files or folders) whose teacher activations fit the linear "
                        "mixers' output scales")
    i.add_argument("--calib-tokens", type=int, default=InitConfig.calib_tokens, help="calibration tokens (0: no calibration)")
    i.add_argument("--calib-seq-len", type=int, default=InitConfig.calib_seq_len,
                   help="tokens per calibration window")
    i.add_argument("--overwrite", action="store_true")
    i.add_argument("--remote-code", action="store_true", default=InitConfig.remote_code,
                   help=REMOTE_CODE_HELP)
    i.set_defaults(fn=cmd_init)
    r = sub.add_parser("run", help="the whole route: init, ILD of both students, SMART, compose, [align], KD, DPO",
                       epilog=LEVERS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--config", required=True,
                   help="route YAML: output_dir, teacher, init, ild, smart, [align], kd, dpo, report")
    r.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    r.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. smart.n_mla=8")
    r.set_defaults(fn=cmd_run)
    add_stage_commands(sub)
    add_sample(sub)
    add_smart(sub)
    add_compose(sub)
    rp = sub.add_parser("report", help="perplexity of the teacher and of the hybrid after each stage of a route")
    rp.add_argument("--route-dir", required=True, help="the output_dir of `upcycle run`")
    rp.add_argument("--data", default=None, help="packed data whose validation split is the held-out text "
                    "(default: the route's ild.data.path)")
    rp.add_argument("--seq-len", type=int, default=512)
    rp.add_argument("--heldout-sources", nargs="+", default=None,
                    help="held-out text (b) that no stage trains on (default: the route config's report.heldout_sources)")
    rp.add_argument("--tokens", type=int, default=65536, help="held-out tokens to score")
    rp.add_argument("--cloze-items", type=int, default=None,
                    help="austen_cloze items to score each model on; 0: none (default: the route config's report.cloze_items)")
    rp.add_argument("--generation-prompts", type=int, default=None,
                    help="held-out asset:c4_demo prompts each model continues greedily, scored by the teacher; 0: none "
                         "(default: the route config's report.generation_prompts)")
    rp.add_argument("--generation-tokens", type=int, default=None,
                    help="tokens of each greedy continuation (default: the route config's, else 64)")
    rp.add_argument("--ruler-lengths", type=int, nargs="*", default=None,
                    help="context lengths of the RULER-style tasks each model is scored on (none: no RULER; default: "
                         "the route config's report.ruler_lengths)")
    rp.add_argument("--ruler-items", type=int, default=None,
                    help="RULER items per task and length (default: the route config's report.ruler_items, else 5)")
    rp.set_defaults(fn=cmd_report)
    k = sub.add_parser("kv-report", help="KV-cache size of a hybrid against its Llama teacher, without weights")
    k.add_argument("--teacher", required=True, help="config.json, model directory, or asset:smollm2")
    k.add_argument("--mla-layers", required=True, help="comma-separated MLA layer indices, e.g. 0,5,10,14")
    k.add_argument("--kv-lora-rank", "--kv-rank", type=int, required=True, action=RenamedFlag, old=("--kv-rank",),
                   help="the MLA layers' kv latent rank (--kv-rank: its old name)")
    k.add_argument("--qk-rope-head-dim", "--rope-dim", type=int, required=True, action=RenamedFlag,
                   old=("--rope-dim",), help="decoupled RoPE dims per head (--rope-dim: its old name)")
    k.add_argument("--linear-mixer", choices=linear_kinds(), default=InitConfig.linear_mixer,
                   help="the mixer of the other layers (its fixed-size state is reported)")
    k.set_defaults(fn=cmd_kv_report)
    add_plan(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    STOP.install()  # first: from here to the exit a SIGTERM / SIGUSR1 is a request (exit 143, `stopped:`)
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.fn(args), user_errors=(ConfigError, FileExistsError))


if __name__ == "__main__":
    raise SystemExit(main())
