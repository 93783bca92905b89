"""The stateless causal conv kernel (hybridlm/ops/causal_conv.py), CPU.

1. Its torch twin against the model's torch path (``short_conv``, what every mixer runs on CPU) and against an
   explicit loop over taps: forward, and gradients of x, weight and bias.
2. The Triton forward and backward kernels through the interpreter (``TRITON_INTERPRET=1``, a subprocess)
   against the twin: fp32 to ~1e-5 (values and the three gradients); bf16 within a rounding. Cases cover
   sequences shorter than, equal to and longer than one 64-row tile (and not a multiple of it), widths 2 to 4,
   with and without bias and SiLU, and ``x`` as a strided slice of a wider projection (as Mamba2 passes it); the
   backward's pass 1 with one and with two time tiles per program.
The GPU twin of this test (compiled kernels against the twin and fla) is tests/gpu/test_causal_conv_gpu.py.
"""
import json

import pytest
import torch

from conftest import interpreter_rounds_like_gpu, interpreter_run_of, kernel_case_row
from hybridlm.ops.causal_conv import causal_conv_reference
from hybridlm.ops.elementwise import short_conv

F32, BF16 = torch.float32, torch.bfloat16
# (batch, time, channels, width, bias, silu, dtype, strided x)
CASES = [
    (2, 70, 24, 4, True, True, F32, False),     # two tiles, the second partial
    (1, 64, 17, 4, False, True, F32, True),     # exactly one tile; channels not a block multiple; strided
    (2, 5, 8, 3, True, False, F32, False),      # shorter than a tile; no SiLU
    (1, 130, 16, 2, True, True, F32, True),
    (2, 70, 24, 4, True, True, BF16, True),
]


def _inputs(case, seed):
    B, T, D, W, bias, silu, dtype, strided = case
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(B, T, D + 5 if strided else D, generator=g).to(dtype)
    x = full[..., 3:3 + D] if strided else full
    weight = (torch.randn(D, W, generator=g) * 0.5).to(dtype)
    b = (torch.randn(D, generator=g) * 0.3).to(dtype) if bias else None
    dy = torch.randn(B, T, D, generator=g).to(dtype)
    return x, weight, b, silu, dy


def _grads(fn, x, weight, b, silu, dy):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, weight, b)]
    y = fn(leaves[0], leaves[1], leaves[2], silu)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


def _explicit(x, weight, b, silu):
    """y[t] = b + sum_i w[:, i] x[t - W + 1 + i], a loop over taps."""
    W = weight.shape[-1]
    y = torch.zeros_like(x, dtype=torch.float32) + (0 if b is None else b.float())
    for i in range(W):
        shift = W - 1 - i
        xs = torch.nn.functional.pad(x.float(), (0, 0, shift, 0))[:, :x.shape[1]]
        y = y + xs * weight[:, i].float()
    return (torch.nn.functional.silu(y) if silu else y).to(x.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c[6] == F32], ids=str)
def test_twin_equals_the_torch_path_and_an_explicit_loop(case):
    x, weight, b, silu, dy = _inputs(case, 0)
    twin = _grads(causal_conv_reference, x, weight, b, silu, dy)
    path = _grads(lambda x, w, b, s: short_conv(x, w, b, "silu" if s else None, triton=False), x, weight, b, silu, dy)
    loop = _grads(_explicit, x, weight, b, silu, dy)
    for a, p, l in zip(twin, path, loop):
        torch.testing.assert_close(a, p, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, l, rtol=1e-5, atol=1e-5)


TILES = (1, 2)  # time tiles per program of the backward's pass 1: 2 leaves a partial group at 70 and 130 rows


def run_kernel_cases() -> list:
    import hybridlm.ops.causal_conv as conv
    interpreter_rounds_like_gpu()
    rows = []
    for tiles in TILES:
        conv.TILES_PER_PROGRAM = tiles
        for seed, case in enumerate(CASES):
            x, weight, b, silu, dy = _inputs(case, seed)
            want = _grads(causal_conv_reference, x, weight, b, silu, dy)
            got = _grads(conv.causal_conv, x, weight, b, silu, dy)
            rows.append(kernel_case_row(got, want, case=repr(case), tiles=tiles, bf16=case[6] == BF16, bias=case[4]))
    return rows


interpreter_run = interpreter_run_of(__file__)


def test_kernels_equal_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run) == len(CASES) * len(TILES)
    for r in interpreter_run:
        assert r["dtypes_ok"] and r["n"] == 3 + r["bias"], r  # y, dx, dw (, db)
        # bf16: y and dx within a rounding of the fp32-math twin; the weight / bias sums over many rows
        assert max(r["errors"]) < (1e-5 if not r["bf16"] else 2e-2), r


def test_pass1_takes_many_time_tiles_only_where_the_grid_stays_full():
    import hybridlm.ops.causal_conv as conv
    assert conv.TILES_PER_PROGRAM == 0  # the default picks by width
    assert conv.pass1_tiles(256, 32) == 1  # GDN's narrow q / k width: a whole sequence per program starves the grid
    assert conv.pass1_tiles(3072, 32) == conv.WIDE_TILES == 32
    assert conv.pass1_tiles(1024, 5) == 5  # no more tiles than the sequence has


if __name__ == "__main__":  # python tests/test_causal_conv.py -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases()))
