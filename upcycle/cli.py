"""``upcycle``: turn a pretrained Llama into MLA / Mamba2 students and report KV-cache sizes.

    upcycle init --teacher asset:smollm2 --out runs/upcycle/init [--kv-rank 128 --rope-dim 32 ...]
    upcycle kv-report --teacher configs/llama/llama-3.2-1b.json --mla-layers 0,5,10,14 --kv-rank 128 --rope-dim 32

Every stage reads and writes transformers-format directories; outputs appear atomically.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional

from hybridlm.config.errors import ConfigError
from hybridlm.training.exits import run_cli
from hybridlm.utils.atomic import write_json


def _layers(text: str) -> List[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--mla-layers: expected comma-separated layer indices, got {text!r}") from None


def cmd_kv_report(args) -> dict:
    from upcycle.kv_report import format_kv_report, kv_report, load_teacher_config
    from upcycle.teacher import resolve_teacher
    source = args.teacher if str(args.teacher).endswith(".json") else resolve_teacher(args.teacher)
    report = kv_report(load_teacher_config(source), _layers(args.mla_layers), args.kv_rank, args.rope_dim)
    print(format_kv_report(report))
    return report


def init_students(teacher_spec, out, *, q_rank=None, kv_rank=128, energy=None, rope_dim=32,
                  rope_init="frequency_matched", linear_mixer="mamba2", seed=0,
                  calib_sources=("asset:janeausten",), calib_tokens=4096, calib_seq_len=512,
                  overwrite=False, remote_code=False) -> dict:
    """Build and save the pure-MLA and pure linear-mixer students of a Llama teacher (``upcycle init``).

    The linear mixers' output scales are fitted to the teacher's attention outputs on ``calib_tokens`` tokens
    of ``calib_sources`` (:mod:`upcycle.calibrate`; ``calib_tokens: 0`` skips it). ``remote_code``: also write
    ``hybrid_lm_auto.py`` into each student (:func:`hybridlm.model.configuration.write_remote_code`)."""
    import torch
    from hybridlm.model import HybridForCausalLM
    from hybridlm.utils.atomic import atomic_directory
    from upcycle.init_mamba import init_student_from_teacher
    from upcycle.init_mla import energy_ranks
    from upcycle.kv_report import format_kv_report, kv_report
    from upcycle.student import llama_shapes, student_config
    from upcycle.teacher import load_teacher, load_teacher_tokenizer

    teacher = load_teacher(teacher_spec, dtype=torch.float32)
    tokenizer = load_teacher_tokenizer(teacher_spec)
    s = llama_shapes(teacher.config)
    ranks = {"q_lora_rank": q_rank or s["n_h"] * s["d_h"], "kv_lora_rank": kv_rank}
    if energy is not None:  # one MLA shape for all layers: the largest rank any layer needs
        ranks = energy_ranks([l.self_attn for l in teacher.model.layers], s["n_h"], s["n_kv"], s["d_h"],
                             rope_dim, energy, rope_init)
    out = Path(out)
    summary = {"teacher": str(teacher_spec), "ranks": ranks, "rope_dim": rope_dim, "rope_init": rope_init,
               "students": {}}
    for kind in ("mla", linear_mixer):
        kinds = [kind] * s["L"]
        cfg = student_config(teacher.config, kinds, rope_dim=rope_dim, rope_init=rope_init, **ranks)
        torch.manual_seed(seed)
        student = HybridForCausalLM(cfg)
        info = init_student_from_teacher(student, teacher, kinds, mla_options={"rope_init": rope_init})
        if kind != "mla" and calib_tokens:
            summary["calibration"] = _calibrate(student, teacher, tokenizer, kinds, calib_sources, calib_tokens,
                                                calib_seq_len)
        target = out / f"{kind}_student"
        with atomic_directory(target, overwrite=overwrite) as tmp:
            student.save_pretrained(tmp, remote_code=remote_code)
            tokenizer.save_pretrained(tmp)
        kv = kv_report(teacher.config, range(s["L"]) if kind == "mla" else [], ranks["kv_lora_rank"], rope_dim)
        energy_kept = info["mla"]
        summary["students"][kind] = {
            "path": str(target), "params": sum(p.numel() for p in student.parameters()),
            "kv_values_per_token": kv["hybrid_values_per_token"],
            "teacher_kv_values_per_token": kv["teacher_values_per_token"], "kv_ratio": kv["ratio"],
            "min_energy_kept": ({k: min(e[k] for e in energy_kept.values()) for k in ("q_energy", "kv_energy")}
                                if energy_kept else None)}
        print(f"{kind} student -> {target}")
        print(format_kv_report(kv))
    write_json(out / "init_report.json", summary)
    return summary


def _calibrate(student, teacher, tokenizer, kinds, sources, tokens, seq_len) -> dict:
    """Fit the linear student's output scales (on the GPU when there is one) and summarise the fit."""
    import torch
    from upcycle.calibrate import calibrate_student, calibration_batch

    if isinstance(sources, str):
        sources = [sources]
    ids = calibration_batch(tokenizer, list(sources), int(tokens), int(seq_len))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher.to(device)
    student.to(device)
    try:
        per_layer = calibrate_student(student, teacher, ids, kinds)
    finally:
        teacher.cpu()
        student.cpu()
    before = [r["rel_err_before"] for r in per_layer.values()]
    after = [r["rel_err_after"] for r in per_layer.values()]
    print(f"calibrated {len(per_layer)} mixers on {ids.numel()} tokens: relative error of the mixer output "
          f"{sum(before) / len(before):.3g} -> {sum(after) / len(after):.3g} (mean over layers)", flush=True)
    return {"sources": list(sources), "tokens": ids.numel(), "mean_rel_err_before": sum(before) / len(before),
            "mean_rel_err_after": sum(after) / len(after), "layers": per_layer}


def cmd_init(args) -> dict:
    return init_students(args.teacher, args.out, q_rank=args.q_rank, kv_rank=args.kv_rank, energy=args.energy,
                         rope_dim=args.rope_dim, rope_init=args.rope_init, linear_mixer=args.linear_mixer,
                         seed=args.seed, calib_sources=args.calib_sources, calib_tokens=args.calib_tokens,
                         overwrite=args.overwrite, remote_code=args.remote_code)


def cmd_run(args) -> dict:
    from hybridlm.config.loader import load_config
    from upcycle.route import ROUTE_SECTIONS, run_route
    return run_route(load_config(args.config, args.overrides, sections=ROUTE_SECTIONS))


def cmd_ild(args) -> dict:
    from hybridlm.config.loader import load_config
    from upcycle.stage import STAGE_SECTIONS, run_ild
    return run_ild(load_config(args.config, args.overrides, sections=STAGE_SECTIONS))


def cmd_report(args) -> dict:
    from upcycle.route_report import route_report
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
    return route_report(args.route_dir, data, seq_len=args.seq_len, max_tokens=args.tokens, heldout_sources=sources,
                        cloze_items=cloze)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="upcycle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="build the pure-MLA (SVD) and pure linear-mixer (MambaInLlama) students")
    i.add_argument("--teacher", required=True, help="Llama directory, .gguf file, or asset:smollm2")
    i.add_argument("--out", required=True)
    i.add_argument("--q-rank", type=int, default=None, help="q latent rank (default: full, n_heads * head_dim)")
    i.add_argument("--kv-rank", type=int, default=128, help="kv latent rank r_kv")
    i.add_argument("--energy", type=float, default=None, help="choose ranks by kept sigma^2 energy instead (0-1]")
    i.add_argument("--rope-dim", type=int, default=32, help="decoupled RoPE dims per head")
    i.add_argument("--rope-init", choices=("frequency_matched", "published"), default="frequency_matched")
    i.add_argument("--linear-mixer", choices=("mamba2", "gdn", "kda"), default="mamba2")
    i.add_argument("--seed", type=int, default=0, help="seed of the default-initialised parameters (z, dt, conv)")
    i.add_argument("--calib-sources", nargs="+", default=["asset:janeausten"],
                   help="text (asset:<name>, .txt files or folders) whose teacher activations fit the linear "
                        "mixers' output scales")
    i.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens (0: no calibration)")
    i.add_argument("--overwrite", action="store_true")
    i.add_argument("--remote-code", action="store_true",
                   help="also write hybrid_lm_auto.py and an auto_map, so the folder loads with trust_remote_code=True "
                   "without importing the toolkit; whoever loads it that way runs that .py "
                   "(only for sharing with people who do not use the toolkit)")
    i.set_defaults(fn=cmd_init)
    r = sub.add_parser("run", help="the whole route: init, ILD of both students, SMART, compose, KD, DPO")
    r.add_argument("--config", required=True, help="route YAML: output_dir, teacher, init, ild, smart, kd, dpo")
    r.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    r.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. smart.n_mla=8")
    r.set_defaults(fn=cmd_run)
    d = sub.add_parser("ild", help="Intermediate Layer Distillation of a student (teacher-forced, per layer)")
    d.add_argument("--config", required=True, help="stage YAML: teacher, student, data, optim, run sections")
    d.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    d.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. student.path=... optim.lr=1e-4")
    d.set_defaults(fn=cmd_ild)
    from distill import dpo_stage, kd
    from upcycle.smart_stage import add_subcommands as add_smart_and_compose
    add_smart_and_compose(sub)
    kd.add_subcommands(sub)
    dpo_stage.add_subcommands(sub)
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
    rp.set_defaults(fn=cmd_report)
    k = sub.add_parser("kv-report", help="KV-cache size of a hybrid against its Llama teacher, without weights")
    k.add_argument("--teacher", required=True, help="config.json, model directory, or asset:smollm2")
    k.add_argument("--mla-layers", required=True, help="comma-separated MLA layer indices, e.g. 0,5,10,14")
    k.add_argument("--kv-rank", type=int, required=True)
    k.add_argument("--rope-dim", type=int, required=True)
    k.set_defaults(fn=cmd_kv_report)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.fn(args), user_errors=(ConfigError, FileExistsError))


if __name__ == "__main__":
    raise SystemExit(main())
