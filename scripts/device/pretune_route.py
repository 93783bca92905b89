"""Warm fla's Triton autotune cache for the SmolLM2 hybrid's shapes (random weights, no teacher needed), so
that the route's stages start training at once. Run on the device before `upcycle run`, even in another call
on the same machine: Triton keeps the tuned configs in $TRITON_CACHE_DIR.

    python3 scripts/device/pretune_route.py TEACHER_CONFIG_JSON [--n-mla 8 --kv-rank 128 --rope-dim 16]
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig

from hybridlm.model import HybridForCausalLM
from upcycle.student import student_config


def route_config(teacher_config: str, n_mla: int = 8, kv_rank: int = 128, rope_dim: int = 16):
    """The route's hybrid config from the teacher's config.json: n_mla MLA layers spread evenly from layer 0,
    Mamba2 elsewhere. Returns (teacher LlamaConfig, hybrid config)."""
    llama = LlamaConfig.from_dict(json.load(open(teacher_config)))
    L = llama.num_hidden_layers
    kinds = ["mla" if i % (L // n_mla) == 0 and i // (L // n_mla) < n_mla else "mamba2" for i in range(L)]
    return llama, student_config(llama, kinds, kv_lora_rank=kv_rank, rope_dim=rope_dim)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--n-mla", type=int, default=8)
    p.add_argument("--kv-rank", type=int, default=128)
    p.add_argument("--rope-dim", type=int, default=16)
    p.add_argument("--shapes", default="16x1024,8x777", help="batch x length pairs to run")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="also save this random-weight hybrid (bf16): the route's architecture, for the "
                        "generation benchmark while the route still trains (weights do not change its work)")
    p.add_argument("--save-teacher", default=None, metavar="DIR",
                   help="also save a random-weight LlamaForCausalLM of the teacher's config (bf16): the teacher's "
                        "architecture, for the generation benchmark on a machine without the teacher's weights")
    args = p.parse_args()
    llama, cfg = route_config(args.config, args.n_mla, args.kv_rank, args.rope_dim)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a rehearsal of the device scripts
    model = HybridForCausalLM(cfg).to(device)
    for shape in args.shapes.split(","):
        b, t = (int(v) for v in shape.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (b, t), device=device)
        t0 = time.perf_counter()
        for _ in range(2):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"pretune {shape}: {time.perf_counter() - t0:.1f}s (loss {loss.item():.3f})", flush=True)
    if args.save:
        model.to(torch.bfloat16).save_pretrained(args.save)
        print(f"saved the architecture twin to {args.save}", flush=True)
    if args.save_teacher:
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(llama).to(torch.bfloat16).save_pretrained(args.save_teacher)
        print(f"saved the teacher's architecture twin to {args.save_teacher}", flush=True)


if __name__ == "__main__":
    main()
