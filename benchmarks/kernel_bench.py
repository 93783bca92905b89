"""The project's Triton kernels against the fla kernels they replace, forward and backward, on a GPU, at the 300M
models' training shapes (BENCHMARKS.md, "Training step breakdown"): one JSON line per (op, shape) with the
milliseconds of each, the bytes the work must move and the time that takes at the GPU's memory bandwidth (the
memory floor; ``--hbm-tbps``, default the H200's 4.8 TB/s, an H100 SXM's is 3.35).

    python benchmarks/kernel_bench.py --out OUT_DIR [--ops conv conv_split conv_head_norm norm ce head_gemm]
        [--micro-batch 64] [--seq 2048] [--iters 20] [--hbm-tbps 4.8]

Writes the lines to stdout and appends them to OUT_DIR/kernel_bench.jsonl. Triton's cache is OUT_DIR/triton-cache
unless TRITON_CACHE_DIR is set (the first call of each kernel autotunes: minutes on an empty cache).

conv: the short conv + SiLU (hybridlm/ops/causal_conv.py against fla's causal_conv1d), x a strided slice of the
projection as the mixers pass it, for each ``--conv-tiles`` of the backward's pass 1 (with the autotuner's pick of
channel block, rows at a time and warps), then at the best of them with ``X_ONCE`` offered to pass 1's autotuner
(``project_x_once_offered_*``: its pick says whether it won). conv_split: GDN-300M's q | k | v, three convs (the project's kernel, one per
block) against one ``causal_conv_split`` over the joined columns (``split_conv_outputs``). conv_head_norm: the same
with q and k normalised and repeated per value head in the kernels (``qk_norm_in_conv``) against the split conv, fla's
l2norm and ``repeat_interleave``. norm: the residual-add
RMSNorm (hybridlm/ops/rms_norm.py against fla's rms_norm with ``residual=``), and Mamba2's output stage
(hybridlm/ops/gated_norm.py against ``addcmul`` + fla's grouped gated norm). ce: the cross-entropy of one chunk of LM-head logits with its gradient
(hybridlm/ops/cross_entropy.py, one launch, against fla's fused cross-entropy forward + backward), also for
each sweep block and warp count of the project's kernel (``--ce-configs``). head_gemm: the chunked LM head's three
GEMMs (hybridlm/model/loss.py) as they run and in other formulations (operand layouts, vocabulary blocks,
cuBLASLt), with TFLOP/s.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

HBM_BYTES_PER_S = 4.8e12
# (name, channels, width of the projection the conv's input is sliced from (0: its own tensor))
# GDN-300M's fused input projection is q | k | v | beta | decay | gate: 256 + 256 + 512 + 8 + 8 + 512 columns
CONV_SHAPES = [("mamba2_300m xbc", 3072, 5152), ("gdn_300m q / k", 256, 1552), ("gdn_300m v", 512, 1552)]


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


def _floor(row: dict, nbytes: int, ours: str, peer: str) -> dict:
    row["bytes_fwd_bwd"] = nbytes
    row[f"floor_ms_at_{HBM_BYTES_PER_S / 1e12:g}TBps"] = nbytes / HBM_BYTES_PER_S * 1e3
    row["speedup_fwd_bwd"] = row[f"{peer}_fwd_bwd_ms"] / row[f"{ours}_fwd_bwd_ms"]
    return row


def _fwd_and_fwd_bwd(fn, x, grads, params):
    """Two closures to time: ``fn(x)`` without autograd, and ``fn`` forward + backward with ``grads`` as its
    outputs' gradients (the gradients of x and ``params`` cleared after each)."""
    xg = x.detach().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            fn(x)

    def fwd_bwd():
        out = fn(xg)
        torch.autograd.backward(list(out) if isinstance(out, (list, tuple)) else [out], grads)
        xg.grad = None
        for p in params:
            p.grad = None
    return fwd, fwd_bwd


def bench_conv(args) -> list:
    from fla.modules.convolution import causal_conv1d

    import hybridlm.ops.causal_conv as conv
    causal_conv, default_tiles = conv.causal_conv, conv.TILES_PER_PROGRAM
    rows = []
    for name, D, proj in CONV_SHAPES:
        torch.manual_seed(0)
        base = torch.randn(args.micro_batch, args.seq, proj or D, device="cuda", dtype=torch.bfloat16)
        x = base[..., :D] if proj else base
        weight = (torch.rand(D, 4, device="cuda") - 0.5).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(args.micro_batch, args.seq, D, device="cuda", dtype=torch.bfloat16)
        kernels = {"project": lambda x: causal_conv(x, weight, None),
                   "fla": lambda x: causal_conv1d(x=x, weight=weight, bias=None, activation="silu")[0]}
        row = {"op": "conv", "shape": name, "B": args.micro_batch, "T": args.seq, "D": D, "strided": bool(proj)}
        for kname, fn in kernels.items():
            fwd, fwd_bwd = _fwd_and_fwd_bwd(fn, x, [dy], [weight])
            row[f"{kname}_fwd_ms"] = timed(fwd, args.iters)
            if kname == "project":  # each count of time tiles per program of the backward's pass 1
                tiles = {}
                for n in args.conv_tiles:
                    conv.TILES_PER_PROGRAM = n
                    tiles[n] = timed(fwd_bwd, args.iters)
                best = min(tiles, key=tiles.get)
                row.update({"project_tiles_ms": tiles, "project_best_tiles": best, "project_fwd_bwd_ms": tiles[best]})
                row["project_pass1_config"] = str(conv._kernels()[1].best_config)  # the winner at the last count
                # pass 1's autotuner also offered X_ONCE, at the best tiles count (the kernels rebuilt, re-tuned)
                conv.TILES_PER_PROGRAM = best
                conv.offer_pass1_x_once(True)
                row["project_x_once_offered_fwd_bwd_ms"] = timed(fwd_bwd, args.iters)
                row["project_x_once_offered_pass1_config"] = str(conv._kernels()[1].best_config)
                conv.offer_pass1_x_once(False)
                conv.TILES_PER_PROGRAM = default_tiles
            else:
                row[f"{kname}_fwd_bwd_ms"] = timed(fwd_bwd, args.iters)
        # forward reads x and writes y; backward reads x and dy and writes dx
        rows.append(_floor(row, 5 * args.micro_batch * args.seq * D * 2, "project", "fla"))
    return rows


def bench_conv_split(args) -> list:
    from hybridlm.ops.causal_conv import causal_conv, causal_conv_split
    widths, proj = (256, 256, 512), 1552
    D = sum(widths)
    torch.manual_seed(0)
    base = torch.randn(args.micro_batch, args.seq, proj, device="cuda", dtype=torch.bfloat16)
    weights = [(torch.rand(w, 4, device="cuda") - 0.5).to(torch.bfloat16).requires_grad_(True) for w in widths]
    dys = [torch.randn(args.micro_batch, args.seq, w, device="cuda", dtype=torch.bfloat16) for w in widths]
    starts = (0, 256, 512)
    kernels = {"split": lambda x: causal_conv_split(x[..., :D], torch.cat(weights), None, widths),
               "three": lambda x: [causal_conv(x[..., s:s + w], wt) for s, w, wt in zip(starts, widths, weights)]}
    row = {"op": "conv_split", "shape": "gdn_300m q | k | v", "B": args.micro_batch, "T": args.seq, "D": D}
    for kname, fn in kernels.items():
        fwd, fwd_bwd = _fwd_and_fwd_bwd(fn, base, dys, weights)
        row[f"{kname}_fwd_ms"] = timed(fwd, args.iters)
        row[f"{kname}_fwd_bwd_ms"] = timed(fwd_bwd, args.iters)
    return [_floor(row, 5 * args.micro_batch * args.seq * D * 2, "split", "three")]


def bench_conv_head_norm(args) -> list:
    """GDN-300M's q | k | v with q and k normalised and repeated for the value heads: in the split conv
    (``qk_norm_in_conv``) against the split conv, fla's l2norm and ``repeat_interleave`` (whose backward is the
    sum over the repeats that fla's grouped backward does itself)."""
    from fla.modules.l2norm import l2norm

    from hybridlm.ops.causal_conv import HeadNorm, causal_conv_split
    widths, proj, head_dim, repeat = (256, 256, 512), 1552, 64, 2
    norm = HeadNorm(2, head_dim, repeat)
    D = sum(widths)
    B, T = args.micro_batch, args.seq
    torch.manual_seed(0)
    base = torch.randn(B, T, proj, device="cuda", dtype=torch.bfloat16)
    weight = (torch.rand(D, 4, device="cuda") - 0.5).to(torch.bfloat16).requires_grad_(True)
    dys = [torch.randn(B, T, w, device="cuda", dtype=torch.bfloat16) for w in norm.output_widths(widths)]

    def unfused(x):
        q, k, v = causal_conv_split(x[..., :D], weight, None, widths)
        return [l2norm(t.view(B, T, -1, head_dim)).repeat_interleave(repeat, dim=2).view(B, T, -1)
                for t in (q, k)] + [v]

    kernels = {"in_conv": lambda x: causal_conv_split(x[..., :D], weight, None, widths, head_norm=norm),
               "unfused": unfused}
    row = {"op": "conv_head_norm", "shape": "gdn_300m q | k | v, q / k heads x2", "B": B, "T": T, "D": D}
    for kname, fn in kernels.items():
        fwd, fwd_bwd = _fwd_and_fwd_bwd(fn, base, dys, [weight])
        row[f"{kname}_fwd_ms"] = timed(fwd, args.iters)
        row[f"{kname}_fwd_bwd_ms"] = timed(fwd_bwd, args.iters)
    # forward reads x (D) and writes q and k twice and v; backward reads x, the outputs' gradients, writes dx
    moved = B * T * 2 * (D + sum(norm.output_widths(widths)) + D + sum(norm.output_widths(widths)) + D)
    return [_floor(row, moved, "in_conv", "unfused")]


def bench_norm(args) -> list:
    from fla.modules.layernorm import rms_norm as fla_rms_norm

    from hybridlm.ops.rms_norm import rms_norm_kernel
    R, D = args.micro_batch * args.seq, 1024
    torch.manual_seed(0)
    x, delta, dy, ds = (torch.randn(R, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    weight = torch.ones(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kernels = {"project": lambda x, d: rms_norm_kernel(x, weight, 1e-6, d),
               "fla": lambda x, d: fla_rms_norm(d, weight, None, residual=x, eps=1e-6, prenorm=True)}
    row = {"op": "norm", "shape": "residual-add RMSNorm, hidden 1024", "rows": R, "D": D}
    for kname, fn in kernels.items():
        xg, dg = x.clone().requires_grad_(True), delta.clone().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                fn(x, delta)

        def fwd_bwd():
            y, s = fn(xg, dg)
            torch.autograd.backward([y, s], [dy, ds])
            xg.grad = dg.grad = weight.grad = None
        row[f"{kname}_fwd_ms"] = timed(fwd, args.iters)
        row[f"{kname}_fwd_bwd_ms"] = timed(fwd_bwd, args.iters)
    # forward reads x, delta and writes y, s; backward reads s, dy, ds and writes dx
    return [_floor(row, 8 * R * D * 2, "project", "fla"), bench_mamba2_output_stage(args)]


def bench_mamba2_output_stage(args) -> dict:
    """Mamba2-300M's D skip + gated grouped norm: hybridlm/ops/gated_norm.py against addcmul + fla's norm."""
    from hybridlm.ops.elementwise import skip_gated_rms_norm
    R, C, H, G = args.micro_batch * args.seq, 2048, 32, 256
    torch.manual_seed(0)
    y, dout = (torch.randn(R, C, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    proj = torch.randn(R, 2 * C + 1056, device="cuda", dtype=torch.bfloat16)  # x and z slices of in_proj's output
    x, z = proj[:, :C], proj[:, C + 1024:2 * C + 1024]
    D = torch.ones(H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    row = {"op": "norm", "shape": "Mamba2-300M output stage: D skip + gated norm, 2048 channels in 8 groups",
           "rows": R, "C": C}
    for source in ("project", "fla"):
        yg, pg = y.detach().clone().requires_grad_(True), proj.detach().clone().requires_grad_(True)
        xg, zg = pg[:, :C], pg[:, C + 1024:2 * C + 1024]

        def fwd():
            with torch.no_grad():
                skip_gated_rms_norm(y, x, D, z, weight, 1e-5, G, triton=True, norm_kernel=source)

        def fwd_bwd():
            skip_gated_rms_norm(yg, xg, D, zg, weight, 1e-5, G, triton=True, norm_kernel=source).backward(dout)
            yg.grad = pg.grad = D.grad = weight.grad = None
        row[f"{source}_fwd_ms"] = timed(fwd, args.iters)
        row[f"{source}_fwd_bwd_ms"] = timed(fwd_bwd, args.iters)
    # forward reads y, x, z and writes out; backward reads y, x, z, dout and writes dy, dx, dz
    return _floor(row, 11 * R * C * 2, "project", "fla")


def bench_ce(args) -> list:
    from fla.modules.fused_cross_entropy import cross_entropy_loss

    import hybridlm.ops.cross_entropy as ce
    R, V = args.micro_batch * args.seq // 8, 128256  # one of the chunked loss's 8 chunks
    torch.manual_seed(0)
    logits = (torch.randn(R, V, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, V, (R,), device="cuda")
    inv_n = torch.tensor(1.0 / R, device="cuda")
    buf = torch.empty_like(logits)

    def fla():
        leaf = buf.requires_grad_(True)
        losses = cross_entropy_loss(leaf, target, ignore_index=-100, inplace_backward=True)[0]
        torch.autograd.grad(losses, leaf, grad_outputs=inv_n.expand_as(losses))
        buf.requires_grad_(False)

    def ours():
        ce.cross_entropy_kernel(buf, target, inv_n, write_grad=True)

    # each timed call works on a fresh copy of the logits (both kernels write over them); the copy is timed apart
    copy_ms = timed(lambda: buf.copy_(logits), args.iters)
    row = {"op": "ce", "shape": "one chunk of LM-head logits, vocab 128256", "rows": R, "V": V, "copy_ms": copy_ms}
    row["fla_fwd_bwd_ms"] = timed(lambda: (buf.copy_(logits), fla()), args.iters) - copy_ms
    configs = {}
    default = ce.BLOCK_V, ce.NUM_WARPS
    for bv, nw in args.ce_configs:
        ce.BLOCK_V, ce.NUM_WARPS = bv, nw
        configs[f"{bv}x{nw}"] = timed(lambda: (buf.copy_(logits), ours()), args.iters) - copy_ms
    ce.BLOCK_V, ce.NUM_WARPS = default
    best = min(configs, key=configs.get)
    row.update({"project_configs_ms": configs, "project_best": best, "project_fwd_bwd_ms": configs[best]})
    # the floor: the logits read once and the gradient written once (the second sweep's read from cache)
    return [_floor(row, 2 * R * V * 2, "project", "fla")]


def bench_head_gemm(args) -> list:
    """The chunked LM head's three GEMMs (hybridlm/model/loss.py) at the 300M models' shapes (vocabulary 128,256,
    hidden 1,024), one chunk of rows at a time, as the head runs them now and in other formulations: the weight
    stored transposed, and the vocabulary split into blocks small enough for L2 (each block's GEMM writes its
    columns of the logits, or adds its share of the input gradient in fp32). One row per (GEMM, chunk rows), the
    milliseconds and TFLOP/s of each formulation; every formulation's result is checked against the current one."""
    V, K = 128256, 1024
    torch.manual_seed(0)
    w = (torch.randn(V, K, device="cuda") * 0.02).to(torch.bfloat16)
    w_t = w.t().contiguous()
    rows = []
    for R in args.head_chunk_rows:
        h = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
        dl = (torch.randn(R, V, device="cuda") * 1e-4).to(torch.bfloat16)
        logits = torch.empty(R, V, device="cuda", dtype=torch.bfloat16)
        gh = torch.empty(R, K, device="cuda", dtype=torch.bfloat16)
        gh32 = torch.empty(R, K, device="cuda", dtype=torch.float32)
        gw = torch.zeros(V, K, device="cuda", dtype=torch.float32)
        gw_t = torch.zeros(K, V, device="cuda", dtype=torch.float32)

        def vocab_blocks(nb):
            return [(a, min(a + nb, V)) for a in range(0, V, nb)]

        def logits_blocked(nb):
            for a, b in vocab_blocks(nb):
                torch.mm(h, w[a:b].t(), out=logits[:, a:b])
            return logits

        def dh_blocked(nb):
            gh32.zero_()
            for a, b in vocab_blocks(nb):
                torch.addmm(gh32, dl[:, a:b], w[a:b], out_dtype=torch.float32, out=gh32)
            return gh32

        def dw_blocked(nb):
            for a, b in vocab_blocks(nb):
                torch.addmm(gw[a:b], dl[:, a:b].t(), h, out_dtype=torch.float32, out=gw[a:b])

        # each formulation returns its result (the weight gradient's accumulate, so they are timed, not compared)
        gemms = {
            "logits": {"now": lambda: torch.mm(h, w.t(), out=logits),
                       "weight_transposed": lambda: torch.mm(h, w_t, out=logits),
                       **{f"vocab_blocks_{nb}": (lambda nb=nb: logits_blocked(nb)) for nb in args.head_blocks}},
            "input_grad": {"now": lambda: torch.mm(dl, w, out=gh),
                           "weight_transposed": lambda: torch.mm(dl, w_t.t(), out=gh),
                           **{f"vocab_blocks_{nb}_fp32": (lambda nb=nb: dh_blocked(nb)) for nb in args.head_blocks}},
            "weight_grad": {"now": lambda: torch.addmm(gw, dl.t(), h, out_dtype=torch.float32, out=gw),
                            "transposed": lambda: torch.addmm(gw_t, h.t(), dl, out_dtype=torch.float32, out=gw_t),
                            **{f"vocab_blocks_{nb}": (lambda nb=nb: dw_blocked(nb)) for nb in args.head_blocks}},
        }
        for gemm, forms in gemms.items():
            row = {"op": "head_gemm", "gemm": gemm, "rows": R, "V": V, "K": K, "ms": {}, "tflops": {}, "rel_err": {}}
            forms = dict(forms)
            # cuBLASLt instead of cuBLAS for the current form (torch.backends.cuda.preferred_blas_library)
            forms["now_cublaslt"] = forms["now"]
            reference = None
            for name, fn in forms.items():
                torch.backends.cuda.preferred_blas_library("cublaslt" if name == "now_cublaslt" else "cublas")
                try:
                    ms = timed(fn, args.iters)
                    out = fn()
                except RuntimeError as e:  # a formulation this torch / cuBLAS refuses: say so, time the rest
                    row["ms"][name] = f"error: {str(e).splitlines()[0][:120]}"
                    continue
                row["ms"][name], row["tflops"][name] = ms, 2 * R * K * V / ms / 1e9
                if gemm != "weight_grad":
                    out = out.float()
                    reference = out.clone() if reference is None else reference
                    row["rel_err"][name] = ((out - reference).norm() / reference.norm()).item()
            torch.backends.cuda.preferred_blas_library("cublas")
            rows.append(row)
        del h, dl, logits, gh, gh32, gw, gw_t
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    global HBM_BYTES_PER_S
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--ops", nargs="+", choices=("conv", "conv_split", "conv_head_norm", "norm", "ce", "head_gemm"),
                   default=["conv", "conv_split", "conv_head_norm", "norm", "ce"])
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ce-configs", nargs="+",
                   default=[(2048, 4), (4096, 8), (8192, 16)],
                   type=lambda s: tuple(int(v) for v in s.split("x")),
                   help="BLOCK_VxNUM_WARPS of the ce kernel (hybridlm/ops/cross_entropy.py)")
    p.add_argument("--conv-tiles", nargs="+", type=int, default=[1, 32],
                   help="time tiles per program of the conv backward's pass 1 (hybridlm/ops/causal_conv.py; 0: its rule by width)")
    p.add_argument("--head-chunk-rows", nargs="+", type=int, default=[16384, 32768],
                   help="rows of one LM-head chunk (64 x 2048 tokens in 8 chunks: 16384)")
    p.add_argument("--head-blocks", nargs="+", type=int, default=[8192, 16384, 32768],
                   help="vocabulary columns a GEMM at a time in the blocked formulations")
    p.add_argument("--hbm-tbps", type=float, default=HBM_BYTES_PER_S / 1e12,
                   help="the GPU's memory bandwidth in TB/s for the floor (H200: 4.8, H100 SXM: 3.35)")
    p.add_argument("--out", required=True, metavar="OUT_DIR", help="append the JSON lines to OUT_DIR/kernel_bench.jsonl")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: kernel_bench.py needs a CUDA GPU: torch.cuda.is_available() is False")
    HBM_BYTES_PER_S = args.hbm_tbps * 1e12
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.abspath(args.out), "triton-cache"))
    out_file = os.path.join(args.out, "kernel_bench.jsonl")
    for op in args.ops:
        for row in {"conv": bench_conv, "conv_split": bench_conv_split, "conv_head_norm": bench_conv_head_norm,
                    "norm": bench_norm, "ce": bench_ce, "head_gemm": bench_head_gemm}[op](args):
            line = json.dumps(row)
            print(line, flush=True)
            with open(out_file, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
