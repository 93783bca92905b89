"""The stateless causal conv + SiLU, forward and backward, on a GPU: the project's kernels
(hybridlm/ops/causal_conv.py) against fla's causal_conv1d at each mixer's training shapes, one JSON line per
shape with the milliseconds of each, the bytes forward + backward must move and the time that takes at the
H200's ~4.8 TB/s (the memory floor).

    python scripts/device/conv_bench.py [--micro-batch 64] [--out conv_bench.jsonl]
"""
from __future__ import annotations

import argparse
import json

import torch

from hybridlm.ops.causal_conv import causal_conv

# (name, channels, width of the projection the conv's input is sliced from (0: its own tensor))
# GDN-300M's fused input projection is q | k | v | beta | decay | gate: 256 + 256 + 512 + 8 + 8 + 512 columns
SHAPES = [("mamba2_300m xbc", 3072, 5152), ("gdn_300m q / k", 256, 1552), ("gdn_300m v", 512, 1552)]


def timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` CUDA-event-timed calls (after two warm-ups, which autotune)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(name: str, D: int, proj: int, micro_batch: int, seq: int, iters: int) -> dict:
    from fla.modules.convolution import causal_conv1d
    torch.manual_seed(0)
    base = torch.randn(micro_batch, seq, proj or D, device="cuda", dtype=torch.bfloat16)
    x = (base[..., :D] if proj else base).requires_grad_(False)
    weight = (torch.rand(D, 4, device="cuda") - 0.5).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(micro_batch, seq, D, device="cuda", dtype=torch.bfloat16)
    kernels = {"project": lambda x: causal_conv(x, weight, None),
               "fla": lambda x: causal_conv1d(x=x, weight=weight, bias=None, activation="silu")[0]}
    row = {"shape": name, "B": micro_batch, "T": seq, "D": D, "strided": bool(proj)}
    for kname, fn in kernels.items():
        xg = x.detach().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                fn(x)

        def fwd_bwd():
            fn(xg).backward(dy)
            xg.grad = weight.grad = None
        row[f"{kname}_fwd_ms"] = timed(fwd, iters)
        row[f"{kname}_fwd_bwd_ms"] = timed(fwd_bwd, iters)
    tensor = micro_batch * seq * D * 2
    # the floor: forward reads x and writes y; backward reads x and dy and writes dx
    row["bytes_fwd_bwd"] = 5 * tensor
    row["floor_ms_at_4.8TBps"] = 5 * tensor / 4.8e12 * 1e3
    row["speedup_fwd_bwd"] = row["fla_fwd_bwd_ms"] / row["project_fwd_bwd_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    args = p.parse_args()
    for name, D, proj in SHAPES:
        row = measure(name, D, proj, args.micro_batch, args.seq, args.iters)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
