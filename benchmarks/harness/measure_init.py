"""Perplexity right after ``upcycle init`` for several MLA rank / RoPE choices (no training), on held-out
Jane Austen text: how much each choice of the SVD init keeps before any distillation.

    python -m benchmarks.harness.measure_init --teacher asset:smollm2 --out init_ppl.json \
        --variants 32:128 32:576 16:128 16:576 8:576        # qk_rope_head_dim:kv_lora_rank
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridlm.data.assets import corpus_path
from hybridlm.eval.perplexity import perplexity, token_windows
from hybridlm.model import HybridForCausalLM
from hybridlm.utils.atomic import json_text, write_json
from upcycle.init_from_teacher import init_student_from_teacher
from upcycle.student import ROPE_INITS, student_config
from hybridlm.teacher import load_teacher, load_teacher_tokenizer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="asset:smollm2")
    p.add_argument("--variants", nargs="*", default=["32:128", "32:576", "16:128", "16:576", "8:576"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", default="init_ppl.json")
    args = p.parse_args(argv)
    tok = load_teacher_tokenizer(args.teacher)
    teacher = load_teacher(args.teacher)
    book = sorted(Path(corpus_path()).glob("*.txt"))[0]  # Emma: text the teacher was not tuned on here
    windows = token_windows(tok, [book.read_text()[200000:260000]], 256, args.tokens)
    L = teacher.config.num_hidden_layers
    rows = [{"model": "teacher", **perplexity(teacher, windows)}]
    print(json_text(rows[-1]), flush=True)
    for variant in args.variants:
        qk_rope_head_dim, kv_lora_rank = (int(v) for v in variant.split(":"))
        for rope_init in ROPE_INITS:
            cfg = student_config(teacher.config, ["mla"] * L, kv_lora_rank=kv_lora_rank,
                                 qk_rope_head_dim=qk_rope_head_dim, rope_init=rope_init)
            torch.manual_seed(0)
            student = HybridForCausalLM(cfg)
            init_student_from_teacher(student, teacher, ["mla"] * L, mla_options={"rope_init": rope_init})
            rows.append({"model": "all-MLA", "qk_rope_head_dim": qk_rope_head_dim, "kv_lora_rank": kv_lora_rank,
                         "rope_init": rope_init,
                         **perplexity(student, windows)})
            print(json_text(rows[-1]), flush=True)
    write_json(Path(args.out), {"text": f"{book.name}[200000:260000]", "rows": rows})


if __name__ == "__main__":
    main()
