"""Triton-vs-torch parity and first forward+backward timings of every sublayer on one GPU.

    python -m benchmarks.harness.mixers --out mixers.json [--batch 8 --seq 2048 --hidden 1024]

Each sublayer uses the Primus recipe's 300M shapes (hidden 1024). Parity: relative L2 error of output and
gradients, fp32 and bf16, on a short input. Timing: median of forward+backward (bf16 autocast) at
the given batch / sequence, next to flash-linear-attention's own layer of the same shape in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness.parity import compare_paths, set_backend
from hybridlm.model import HybridConfig
from hybridlm.model.layers import build_sublayer
from hybridlm.utils.atomic import write_json

SHAPES_300M = dict(
    vocab_size=128256, hidden_size=1024, intermediate_size=4096, hybrid_override_pattern="*-G-K-S-",
    mla=dict(num_heads=16, q_lora_rank=672, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64),
    gdn=dict(num_heads=4, head_dim=64, num_v_heads=8, head_v_dim=64),
    kda=dict(num_heads=8, head_dim=32, num_v_heads=8, head_v_dim=64),
    mamba2=dict(d_state=64, head_dim=64, n_groups=8, expand=2),
)


def fla_peer(kind: str, hidden: int):
    """flash-linear-attention's layer of the same shape (None where fla has no fast equivalent)."""
    import fla.layers as L
    if kind == "gdn":
        return L.GatedDeltaNet(hidden_size=hidden, head_dim=64, num_heads=4, num_v_heads=8, expand_v=1.0)
    if kind == "kda":
        return L.KimiDeltaAttention(hidden_size=hidden, head_dim=32, num_heads=8, num_v_heads=8, expand_v=2.0)
    if kind == "mamba2":
        return L.Mamba2(num_heads=2 * hidden // 64, head_dim=64, hidden_size=hidden, state_size=64, n_groups=8, expand=2)
    if kind == "mlp":
        from fla.modules import GatedMLP
        return GatedMLP(hidden_size=hidden, intermediate_size=4 * hidden, hidden_act="swish")
    return None


def time_fwd_bwd(module, x, steps: int = 10, warmup: int = 3) -> dict:
    def once():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module(x)
            out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    once()  # the first call includes Triton autotuning
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        once()
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "median_ms": 1e3 * statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="mixers.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--kinds", nargs="*", default=["gdn", "kda", "mamba2", "mla", "mlp"])
    p.add_argument("--parity-seq", type=int, default=2048, help="sequence length of the parity check (batch 2)")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"], help="parity dtypes (none: skip parity)")
    args = p.parse_args(argv)
    import triton
    dev = torch.device("cuda")
    cfg = HybridConfig(**SHAPES_300M)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "batch": args.batch, "seq": args.seq, "hidden": cfg.hidden_size, "parity": {}, "timing": {}}
    start = time.perf_counter()

    def save():
        write_json(args.out, report)

    for kind in args.kinds:
        for dtype in [d for d in (torch.bfloat16, torch.float32) if str(d).split(".")[-1] in args.dtypes]:
            torch.manual_seed(0)
            layer = build_sublayer(cfg, kind).to(dev, dtype)
            t0 = time.perf_counter()
            errs = compare_paths(layer, lambda: torch.randn(2, args.parity_seq, cfg.hidden_size, device=dev, dtype=dtype),
                                 lambda m, x: m(x))
            errs["seconds"] = time.perf_counter() - t0
            report["parity"][f"{kind}/{str(dtype).split('.')[-1]}"] = errs
            print(f"[{time.perf_counter() - start:6.0f}s] parity", kind, dtype, errs, flush=True)
            save()
        if args.skip_timing:
            continue
        torch.manual_seed(0)
        layer = build_sublayer(cfg, kind).to(dev)
        set_backend(layer, "triton")
        x = torch.randn(args.batch, args.seq, cfg.hidden_size, device=dev, requires_grad=True)
        entry = {"ours": time_fwd_bwd(layer, x)}
        del layer
        peer = fla_peer(kind, cfg.hidden_size)
        if peer is not None:
            try:
                entry["fla"] = time_fwd_bwd(peer.to(dev), x)
            except torch.cuda.OutOfMemoryError:
                entry["fla"] = {"error": "out of memory"}
            del peer
        torch.cuda.empty_cache()
        report["timing"][kind] = entry
        print(f"[{time.perf_counter() - start:6.0f}s] timing", kind, entry, flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
