"""Each GDN layer of SmolLM2 initialised from its attention, with each piece of the GDN init switched on or off:
the relative error of the mixer's output against the teacher attention's, teacher-forced, before and after the
output-scale calibration, on calibration text and on held-out text (docs/upcycling_init.md, GDN section).

    python -m benchmarks.harness.gdn_init_variants --out docs/results/upcycling/gdn_init_variants.json \\
        --variants published identity_conv constant_gate identity_conv+constant_gate \\
                   identity_conv+constant_gate+small_beta ours

``published``: q / k / v / o copied, everything else at fla's random init (the convs, the output gate, beta and
the decay input); ``identity_conv`` / ``constant_gate`` / ``small_beta`` / ``constant_decay``: the four pieces of
:func:`upcycle.init_delta_rule.start_as_linear_attention`; ``ours`` = all four (what ``upcycle init`` does).
``beta=0.5`` (any value in (0, 1)) replaces small_beta's value. Relative error: ``sum ||a_s - a_t||^2 / sum
||a_t||^2`` (1.0 = a silent mixer); ``--fit shared`` calibrates the norm weight the heads share instead of one
weight per channel. Calibration and held-out text are different books of Jane Austen.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from distill.ild import teacher_trace
from hybridlm.data.assets import corpus_path
from hybridlm.eval.perplexity import token_windows
from hybridlm.model.layers import GatedDeltaNet, build_sublayer
from hybridlm.teacher import load_teacher, load_teacher_tokenizer
from hybridlm.utils.atomic import json_text, write_json
from upcycle.calibrate import fit_output_scale
from upcycle.init_delta_rule import GDN_INIT_BETA
from upcycle.init_linear import init_linear_mixer_from_attention
from upcycle.init_mamba2 import SILU_INVERSE_OF_ONE, set_conv_identity
from upcycle.student import student_config

PIECES = ("identity_conv", "constant_gate", "small_beta", "constant_decay")


def parse_variant(variant: str) -> dict:
    """``{piece: on}`` plus ``beta`` for one variant string (``ours``, ``published`` or ``+``-joined pieces)."""
    names = set(PIECES) if variant == "ours" else set() if variant == "published" else set(variant.split("+"))
    beta = GDN_INIT_BETA
    for n in [n for n in names if n.startswith("beta=")]:
        beta = float(n.split("=", 1)[1])
        if not 0.0 < beta < 1.0:
            raise ValueError(f"--variants: {n}: beta must lie in (0, 1)")
        names = (names - {n}) | {"small_beta"}
    unknown = names - set(PIECES)
    if unknown:
        raise ValueError(f"--variants: unknown piece {sorted(unknown)[0]!r}; expected published, ours or "
                         f"+-joined {', '.join(PIECES)} (beta=X for another beta)")
    return {**{p: p in names for p in PIECES}, "beta": beta}


@torch.no_grad()
def build_layer(cfg, attn, i: int, pieces: dict, seed: int = 0) -> GatedDeltaNet:
    """A GDN layer initialised from ``attn`` with only ``pieces`` of the GDN init; the others at fla's random
    init (normal(0, 0.02) weights, zero biases)."""
    torch.manual_seed(seed + i)
    m = build_sublayer(cfg, "gdn", i).eval()
    init_linear_mixer_from_attention(m, attn, "gdn")
    g = torch.Generator().manual_seed(seed + 1000 + i)
    for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
        conv.weight.normal_(0.0, 0.02, generator=g) if not pieces["identity_conv"] else set_conv_identity(conv)
    for lin in (m.g_proj, m.b_proj, m.a_proj):
        lin.weight.normal_(0.0, 0.02, generator=g)
    m.g_bias.zero_()
    m.b_bias.zero_()
    if pieces["constant_gate"]:
        m.g_proj.weight.zero_()
        m.g_bias.fill_(SILU_INVERSE_OF_ONE)
    if pieces["small_beta"]:
        m.b_proj.weight.zero_()
        m.b_bias.fill_(math.log(pieces["beta"] / (1.0 - pieces["beta"])))
    if pieces["constant_decay"]:
        m.a_proj.weight.zero_()
    return m


def rel_err(m, h, a) -> float:
    with torch.no_grad():
        return float((m(h).double() - a.double()).pow(2).sum() / a.double().pow(2).sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="asset:smollm2")
    p.add_argument("--variants", nargs="+", default=["published", "ours"])
    p.add_argument("--layers", default="all", help="comma-separated teacher layers, or all")
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--eval-tokens", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--fit", choices=("per_channel", "shared"), default="per_channel",
                   help="calibration: one weight per channel folded into o_proj (upcycle init's), or the norm weight "
                        "shared by the heads")
    p.add_argument("--out", default="gdn_init_variants.json")
    args = p.parse_args(argv)
    try:
        variants = {v: parse_variant(v) for v in args.variants}
    except ValueError as e:
        p.error(str(e))
    tok = load_teacher_tokenizer(args.teacher)
    teacher = load_teacher(args.teacher, dtype=torch.float32).eval()
    books = sorted(Path(corpus_path()).glob("*.txt"))
    calib = torch.stack(token_windows(tok, [books[0].read_text()[100000:160000]], args.seq_len,
                                      args.calib_tokens))[:, :-1]
    held = torch.stack(token_windows(tok, [books[1].read_text()[200000:300000]], args.seq_len,
                                     args.eval_tokens))[:, :-1]
    L = teacher.config.num_hidden_layers
    layers = list(range(L)) if args.layers == "all" else [int(i) for i in args.layers.split(",")]
    cfg = student_config(teacher.config, ["gdn"] * L, kv_lora_rank=128, qk_rope_head_dim=16)
    cfg.runtime = dict(backend="torch")
    with torch.no_grad():
        traces = {"calib": teacher_trace(teacher, calib), "held": teacher_trace(teacher, held)}
    rows = []
    for name, pieces in variants.items():
        t0 = time.perf_counter()
        per_layer = {}
        for i in layers:
            t_layer = teacher.model.layers[i]
            m = build_layer(cfg, t_layer.self_attn, i, pieces)
            (xc, ac, _), (xh, ah, _) = traces["calib"][i], traces["held"][i]
            with torch.no_grad():
                hc, hh = t_layer.input_layernorm(xc), t_layer.input_layernorm(xh)
                fit = fit_output_scale(m, hc, ac, per_channel=args.fit == "per_channel")
            per_layer[i] = {"before": fit["rel_err_before"], "after": fit["rel_err_after"],
                            "held_out_after": rel_err(m, hh, ah)}
        stats = {k: [r[k] for r in per_layer.values()] for k in ("before", "after", "held_out_after")}
        rows.append({"variant": name, "fit": args.fit, **{f"mean_{k}": sum(v) / len(v) for k, v in stats.items()},
                     "max_held_out_after": max(stats["held_out_after"]),
                     "min_held_out_after": min(stats["held_out_after"]),
                     "layers": per_layer, "seconds": round(time.perf_counter() - t0)})
        print(json_text({k: v for k, v in rows[-1].items() if k != "layers"}), flush=True)
    write_json(Path(args.out), {"teacher": args.teacher, "layers": layers,
                                "calibration": f"{books[0].name}[100000:160000], {calib.numel()} tokens",
                                "held_out": f"{books[1].name}[200000:300000], {held.numel()} tokens", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
