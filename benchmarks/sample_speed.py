"""Tokens/s of the teacher-sampled data stage (distill/teacher_samples.py; BENCHMARKS.md, "Upcycling speed") on a
random-weight twin of the SmolLM2-135M teacher: the same shapes, so the same work per token, and with random weights
almost no row ends early, so every continuation runs its whole length (the most work a batch can hold).

    python benchmarks/sample_speed.py --tokenizer TEACHER_DIR --out OUT_DIR [--batch 512] [--gen-len 960] \
        [--prompt-len 64] [--shards 3] [--caches static dynamic]

TEACHER_DIR: any directory holding the teacher's tokenizer files (the twin takes its tokenizer, not its weights).
For each cache the stage writes ``--shards`` shards of ``--batch`` continuations; the first shard carries the static
cache's compilation, so the JSON (OUT_DIR/sample_speed.json) gives the first shard's seconds and the later shards'
new tokens/s apart. Needs a CUDA GPU for figures worth reporting (it runs on the CPU at tiny sizes).
"""
import argparse
import json
import shutil
import statistics
from pathlib import Path

import torch
from route_twin import SMOLLM2  # this folder is on sys.path when run as a script
from transformers import LlamaConfig, LlamaForCausalLM

from distill.teacher_samples import SampleConfig, sample
from hybridlm.data import prepare
from hybridlm.utils.atomic import write_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja")


def twin_teacher(tokenizer_dir: Path, out: Path) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16).save_pretrained(out)
    copied = [f for f in TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
    if "tokenizer.json" not in copied:
        raise SystemExit(f"error: --tokenizer {tokenizer_dir}: no tokenizer.json")
    for f in copied:
        shutil.copy(tokenizer_dir / f, out / f)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, type=Path, help="a directory with the teacher's tokenizer files")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--prompts-source", default="asset:janeausten", help="text the prompts are drawn from")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=960)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--caches", nargs="+", default=["static", "dynamic"], choices=["static", "dynamic"])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = twin_teacher(args.tokenizer, args.out / "twin_teacher")
    prompts = args.out / "prompts"
    if not (prompts / "meta.json").is_file():
        prepare([args.prompts_source], str(teacher), prompts, txt_split="paragraphs", progress=False)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = []
    for cache in args.caches:
        out = args.out / f"samples_{cache}"
        shutil.rmtree(out, ignore_errors=True)
        cfg = SampleConfig(prompts=str(prompts), out=str(out), tokens=args.shards * args.batch * args.gen_len,
                           prompt_len=args.prompt_len, gen_len=args.gen_len, batch_size=args.batch, cache=cache)
        summary = sample(cfg, str(teacher))
        shards = [json.loads(f.read_text()) for f in sorted(out.glob(".shard_*.json"))]
        later = [s["new_tokens"] / s["seconds"] for s in shards[1:]]
        row = {"cache": cache, "device": device, "batch": args.batch, "prompt_len": args.prompt_len,
               "gen_len": args.gen_len, "shards": len(shards), "new_tokens": summary["new_tokens"],
               "first_shard_seconds": shards[0]["seconds"], "shard_seconds": [s["seconds"] for s in shards],
               "new_tokens_per_second_after_first": round(statistics.median(later), 1) if later else None,
               "new_tokens_per_second_all": summary["new_tokens_per_second"],
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}
        print(json.dumps(row), flush=True)
        results.append(row)
    write_json(args.out / "sample_speed.json", {"model": "random-weight twin of SmolLM2-135M (bf16 on a GPU)",
                                                 "prompts_source": args.prompts_source, "results": results})


if __name__ == "__main__":
    main()
