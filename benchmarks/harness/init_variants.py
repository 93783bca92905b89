"""Perplexity of the route's hybrid right after init, for each piece of the Mamba2 init switched on or off:
which part of the MambaInLlama mapping makes an untrained hybrid worse than a uniform guess, and what fixes it.

    python -m benchmarks.harness.init_variants --teacher asset:smollm2 --out docs/results/init_variants.json \
        --variants published silent identity_conv constant_gate identity_conv+constant_gate \
                   identity_conv+calibrated ours published+calibrated

``published``: MambaInLlama (random conv, z rows and gate, norm weight 1); ``silent``: every Mamba2 out_proj
zeroed (no token mixing); ``identity_conv`` / ``constant_gate`` / ``calibrated``: the three changes of
``upcycle.init_mamba2`` / ``upcycle.calibrate``; ``ours`` = all three, what ``upcycle init`` does. Calibration
text and held-out text are different books of Jane Austen; the MLA layers are SMART's route choice.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hybridlm.data.assets import corpus_path
from hybridlm.eval.perplexity import perplexity, token_windows
from hybridlm.model import HybridForCausalLM
from hybridlm.utils.atomic import json_text, write_json
from upcycle.calibrate import calibrate_student
from upcycle.init_from_teacher import init_student_from_teacher
from upcycle.student import student_config
from hybridlm.teacher import load_teacher, load_teacher_tokenizer

ROUTE_MLA_LAYERS = (0, 4, 9, 13, 17, 21, 25, 29)
PIECES = ("identity_conv", "constant_gate", "calibrated", "silent")


def published_mamba2(mixer, seed: int) -> None:
    """Undo this project's changes: MambaInLlama's random conv and z rows, no gate bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bound = mixer.conv1d.weight.shape[-1] ** -0.5
        mixer.conv1d.weight.copy_(torch.empty(mixer.conv1d.weight.shape).uniform_(-bound, bound, generator=g))
        if mixer.conv1d.bias is not None:
            mixer.conv1d.bias.copy_(torch.empty(mixer.conv1d.bias.shape).uniform_(-bound, bound, generator=g))
        mixer.in_proj.weight[:mixer.d_inner].normal_(0.0, 0.02, generator=g)
        mixer.z_bias.zero_()


def build_variant(teacher, kinds, pieces, calib_ids, seed: int = 0):
    cfg = student_config(teacher.config, kinds, kv_lora_rank=128, qk_rope_head_dim=16)
    torch.manual_seed(seed)
    student = HybridForCausalLM(cfg).float()
    init_student_from_teacher(student, teacher, kinds)
    mamba = [student.model.layers[2 * i].mixer for i, k in enumerate(kinds) if k == "mamba2"]
    saved = {}
    for n, m in enumerate(mamba):
        saved[n] = (m.conv1d.weight.detach().clone(), m.conv1d.bias.detach().clone(),
                    m.in_proj.weight[:m.d_inner].detach().clone(), m.z_bias.detach().clone())
        published_mamba2(m, seed + n)
        with torch.no_grad():
            if "identity_conv" in pieces:
                m.conv1d.weight.copy_(saved[n][0]); m.conv1d.bias.copy_(saved[n][1])
            if "constant_gate" in pieces:
                m.in_proj.weight[:m.d_inner].copy_(saved[n][2]); m.z_bias.copy_(saved[n][3])
    if "calibrated" in pieces:
        calibrate_student(student, teacher, calib_ids, kinds)
    if "silent" in pieces:
        for m in mamba:
            with torch.no_grad():
                m.out_proj.weight.zero_()
    return student


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="asset:smollm2")
    p.add_argument("--variants", nargs="+", default=["published", "silent", "ours"])
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--all-mamba2", action="store_true", help="convert every layer (no MLA)")
    p.add_argument("--out", default="init_variants.json")
    args = p.parse_args(argv)
    tok = load_teacher_tokenizer(args.teacher)
    teacher = load_teacher(args.teacher, dtype=torch.float32).eval()
    books = sorted(Path(corpus_path()).glob("*.txt"))
    calib = torch.stack(token_windows(tok, [books[0].read_text()[100000:160000]], args.seq_len,
                                      args.calib_tokens))[:, :-1]
    held_out = token_windows(tok, [books[1].read_text()[200000:300000]], args.seq_len, args.eval_tokens)
    L = teacher.config.num_hidden_layers
    kinds = ["mamba2" if args.all_mamba2 or i not in ROUTE_MLA_LAYERS else "mla" for i in range(L)]
    rows = [{"variant": "teacher", **perplexity(teacher, held_out)}]
    print(json_text(rows[-1]), flush=True)
    for variant in args.variants:
        t0 = time.perf_counter()
        pieces = {"ours": {"identity_conv", "constant_gate", "calibrated"}}.get(variant, set(variant.split("+")))
        unknown = pieces - set(PIECES) - {"published"}
        if unknown:
            p.error(f"--variants: unknown piece {sorted(unknown)[0]!r}; expected published, ours or +-joined {PIECES}")
        student = build_variant(teacher, kinds, pieces, calib)
        rows.append({"variant": variant, **perplexity(student, held_out), "seconds": round(time.perf_counter() - t0)})
        print(json_text(rows[-1]), flush=True)
    write_json(Path(args.out), {"mla_layers": [i for i, k in enumerate(kinds) if k == "mla"],
                                "calibration": f"{books[0].name}[100000:160000]",
                                "held_out": f"{books[1].name}[200000:300000]", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
