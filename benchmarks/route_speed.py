"""Seconds per step of the upcycling route's ILD and KD steps on the shared engine (BENCHMARKS.md, "Upcycling
speed"), on a random-weight twin of the SmolLM2-135M teacher (same shapes, so the same work per token): the
figures the route config's stage lengths are sized by (configs/upcycle/smollm2_route_h200.yaml).

    python benchmarks/route_speed.py --out OUT_DIR/route_speed.json [--seq 1024] [--micro 16 32] [--steps 6] \
        [--stages ild kd kd_torch_chunks]

One JSON line per (stage, micro-batch) as it is measured: ILD of the pure-MLA and of the pure-Mamba2 student
(each block against the teacher's, blocks trainable), then KD of the composed hybrid (every parameter); seconds
per step, tokens/s, peak GiB. Needs a CUDA GPU; bash benchmarks/route.sh runs it first with SPEED=1.
"""
import argparse
import os
import time

import torch
from route_twin import SMOLLM2  # this folder is on sys.path when run as a script
from transformers import LlamaConfig, LlamaForCausalLM

from distill.ild import ild_loss
from distill.kd_loss import kd_loss
from hybridlm.engine import Engine, OptimConfig, init_distributed
from hybridlm.model import HybridForCausalLM
from hybridlm.utils.atomic import json_text, write_json
from upcycle.student import student_config

ROUTE_MLA = (0, 4, 9, 13, 17, 21, 25, 29)


def time_stage(name, student, loss_fn, trainable, micro, seq, steps, warmup):
    optim = OptimConfig(micro_batch_size=micro, global_batch_size=micro, lr=1e-4, warmup_steps=1,
                        max_steps=steps + warmup, precision="bf16")
    engine = Engine(student, optim, lambda m, b: loss_fn(m.module, b), trainable=list(trainable(student)))
    batch = {"input_ids": torch.randint(0, SMOLLM2["vocab_size"], (micro, seq))}
    batch["labels"] = batch["input_ids"]
    for _ in range(warmup):
        engine.train_step([batch])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        r = engine.train_step([batch])
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    out = {"stage": name, "micro": micro, "seq": seq, "s_per_step": dt, "tokens_per_s": micro * seq / dt,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(r.loss)}
    print(json_text(out), flush=True)
    del engine
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, nargs="+", default=[16, 32])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", required=True, help="the JSON report (its folder is created)")
    p.add_argument("--stages", nargs="+", choices=("ild", "kd", "kd_torch_chunks"), default=["ild", "kd"],
                   help="kd_torch_chunks: KD with each loss chunk's arithmetic in torch ops instead of its kernel "
                        "(hybridlm/ops/kd_divergence.py)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: route_speed.py needs a CUDA GPU: torch.cuda.is_available() is False")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    dist = init_distributed()
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(dist.device, torch.bfloat16).eval().requires_grad_(False)
    L = SMOLLM2["num_hidden_layers"]
    rows = []
    for micro in args.micro:
        for name, layer_kinds in (("ild_mla", ["mla"] * L), ("ild_mamba2", ["mamba2"] * L)):
            if "ild" not in args.stages:
                break
            student = HybridForCausalLM(student_config(teacher.config, layer_kinds, kv_lora_rank=128,
                                                       qk_rope_head_dim=16))
            rows.append(time_stage(name, student, lambda s, b: ild_loss(s, teacher, b["input_ids"]),
                                   lambda s: s.model.layers.parameters(), micro, args.seq, args.steps, args.warmup))
        layer_kinds = ["mla" if i in ROUTE_MLA else "mamba2" for i in range(L)]
        for name, kernel in (("kd", None), ("kd_torch_chunks", False)):
            if name not in args.stages:
                continue
            torch.manual_seed(0)
            student = HybridForCausalLM(student_config(teacher.config, layer_kinds, kv_lora_rank=128,
                                                       qk_rope_head_dim=16))
            rows.append(time_stage(name, student, lambda s, b, k=kernel: kd_loss(s, teacher, b, chunk_kernel=k),
                                   lambda s: s.parameters(), micro, args.seq, args.steps, args.warmup))
    write_json(args.out, {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
