"""Two questions about the Mamba2 sublayer on a GPU, one JSON line per answer (BENCHMARKS.md, "Numerics"; the
fp32 bound of tests/gpu/test_triton_paths.py rests on the first).

1. tf32: is the fp32 Triton-vs-torch gap of a decay parameter's gradient (Mamba2 dt_bias ~1e-2) the noise of
   TF32 dots? fla's kernels use TF32 even for fp32 inputs. The torch path run with TF32 matmuls, against the
   same path in full fp32, shows how large TF32's error is on each gradient; the Triton path is measured
   against the same full-fp32 reference. GDN is measured alongside for comparison.
2. conv: does fla's causal_conv1d (forward + backward) run slower on the strided [x | B | C] view of in_proj's
   output than on a contiguous copy of it (copy included)?

    python benchmarks/mamba2_probe.py [--micro-batch 16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

# run as a script (sys.path holds benchmarks/, not the checkout): the checkout importable for benchmarks.harness
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness.mixers import SHAPES_300M  # noqa: E402
from benchmarks.harness.parity import relative_errors, run_path  # noqa: E402
from hybridlm.model import HybridConfig  # noqa: E402
from hybridlm.model.layers import build_sublayer  # noqa: E402
from hybridlm.utils.atomic import json_text  # noqa: E402


def tf32_answer(kind: str, T: int = 300) -> dict:
    cfg = HybridConfig(**SHAPES_300M)
    torch.manual_seed(0)
    layer = build_sublayer(cfg, kind).cuda().float()

    def make_input():
        return torch.randn(2, T, cfg.hidden_size, device="cuda")

    def loss_of(m, x):
        return m(x)

    def torch_path(tf32: bool):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        try:
            return run_path(layer, "torch", make_input, loss_of)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False

    strict = torch_path(False)
    with_tf32 = relative_errors(torch_path(True), strict)
    triton = relative_errors(run_path(layer, "triton", make_input, loss_of), strict)
    return {"question": "tf32", "kind": kind, "torch_tf32_vs_fp32": with_tf32, "triton_vs_fp32": triton}


def conv_answer(micro_batch: int, seq: int = 2048, iters: int = 20) -> dict:
    from fla.modules.convolution import causal_conv1d
    hidden, d_inner, conv_dim, heads = 1024, 2048, 3072, 32  # Mamba2-300M: in_proj -> [z | xBC | dt]
    proj = torch.randn(micro_batch, seq, d_inner + conv_dim + heads, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(conv_dim, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(micro_batch, seq, conv_dim, device="cuda", dtype=torch.bfloat16)

    def step(contiguous: bool):
        src = proj.detach().requires_grad_(True)
        xbc = src[..., d_inner:d_inner + conv_dim]
        if contiguous:
            xbc = xbc.contiguous()
        y, _ = causal_conv1d(x=xbc, weight=weight, bias=None, activation="silu")
        y.backward(grad)

    out = {"question": "conv", "shape": [micro_batch, seq, conv_dim]}
    for contiguous in (False, True, False, True):  # twice each, the first round warms up (autotuning)
        for _ in range(3):
            step(contiguous)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step(contiguous)
        end.record()
        torch.cuda.synchronize()
        out["contiguous_ms" if contiguous else "strided_ms"] = start.elapsed_time(end) / iters
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--micro-batch", type=int, default=16)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: mamba2_probe.py needs a CUDA GPU: torch.cuda.is_available() is False")
    for kind in ("mamba2", "gdn"):
        print(json_text(tf32_answer(kind)), flush=True)
    print(json_text(conv_answer(args.micro_batch)), flush=True)


if __name__ == "__main__":
    main()
