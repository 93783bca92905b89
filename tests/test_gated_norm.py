"""Mamba2's fused output stage (hybridlm/ops/gated_norm.py: D skip, SiLU gate, grouped RMSNorm), CPU.

1. Its torch twin against the model's torch path (``skip_gated_rms_norm`` of hybridlm/ops/elementwise.py: the
   skip, then the grouped gated norm, what Mamba2 runs on CPU) and against an explicit loop over groups:
   outputs, and gradients of y, x, D, z and the weight.
2. The Triton forward and backward kernels through the interpreter (``TRITON_INTERPRET=1``, a subprocess)
   against the twin: fp32 to ~1e-5, bf16 within a rounding. Cases cover x and z as strided slices of one wider
   projection (as the model passes them), several groups of several heads, one group, rows that do not fill the
   last row block and more row blocks than backward programs.
The GPU twin of this test is tests/gpu/test_loss_and_norm_kernels_gpu.py.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import interpreter_rounds_like_gpu, interpreter_run_of, kernel_case_row
from hybridlm.ops.elementwise import skip_gated_rms_norm
from hybridlm.ops.gated_norm import gated_norm_skip_reference

F32, BF16 = torch.float32, torch.bfloat16
# (leading shape, channels, heads, group size, strided x / z, dtype)
CASES = [
    ((2, 7), 32, 4, 16, True, F32),    # two groups of two heads; 14 rows over 3 programs of 2-row blocks
    ((5,), 16, 2, 16, False, F32),     # one group
    ((3, 3), 32, 2, 8, True, F32),     # a head spans two groups (heads of 16, groups of 8)
    ((2, 5), 32, 4, 16, True, BF16),
]
EPS = 1e-5


def _inputs(case, seed):
    lead, C, H, G, strided, dtype = case
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(*lead, C, generator=g).to(dtype)
    if strided:  # x and z slices of one projection, as in_proj's split gives them
        proj = torch.randn(*lead, 2 * C + 5, generator=g).to(dtype)
        x, z = proj[..., 3:3 + C], proj[..., 3 + C:3 + 2 * C]
    else:
        x, z = torch.randn(*lead, C, generator=g).to(dtype), torch.randn(*lead, C, generator=g).to(dtype)
    D = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    weight = (1 + 0.2 * torch.randn(C, generator=g)).to(dtype)
    dout = torch.randn(*lead, C, generator=g).to(dtype)
    return y, x, D, z, weight, G, dout


def _grads(fn, y, x, D, z, weight, G, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, D, z, weight)]
    out = fn(*leaves, G)
    (out.float() * dout.float()).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _twin(y, x, D, z, w, G):
    return gated_norm_skip_reference(y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), D,
                                     z.reshape(-1, z.shape[-1]), w, EPS, G).view(y.shape)


def _torch_path(y, x, D, z, w, G):
    return skip_gated_rms_norm(y, x, D, z, w, EPS, G, triton=False)


def _loop(y, x, D, z, w, G):
    """Group by group: s = y + D_head x, u = s * silu(z), u / rms(u) * w."""
    C = y.shape[-1]
    hd = C // D.shape[0]
    s = y.double() + x.double() * torch.stack([D[c // hd] for c in range(C)]).double()
    u = s * F.silu(z.double())
    parts = []
    for g0 in range(0, C, G):
        ug = u[..., g0:g0 + G]
        parts.append(ug / torch.sqrt((ug * ug).mean(-1, keepdim=True) + EPS))
    return (torch.cat(parts, -1) * w.double()).to(y.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c[5] == F32], ids=str)
def test_twin_equals_the_torch_path_and_a_loop_over_groups(case):
    inputs = _inputs(case, 0)
    twin = _grads(_twin, *inputs)
    for other in (_torch_path, _loop):
        for a, b in zip(twin, _grads(other, *inputs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    from hybridlm.ops.gated_norm import gated_norm_skip
    y = torch.randn(4, 32)
    with pytest.raises(ValueError, match="power of two"):
        gated_norm_skip(y, y, torch.ones(4), y, torch.ones(32), EPS, 12)
    with pytest.raises(ValueError, match="weight \\[32\\]"):
        gated_norm_skip(y, y, torch.ones(4), y, torch.ones(16), EPS, 16)


def run_kernel_cases() -> list:
    from hybridlm.ops.gated_norm import gated_norm_skip
    interpreter_rounds_like_gpu()
    rows = []
    for seed, case in enumerate(CASES):
        inputs = _inputs(case, seed)
        want = _grads(_twin, *inputs)
        got = _grads(lambda y, x, D, z, w, G: gated_norm_skip(y, x, D, z, w, EPS, G), *inputs)
        rows.append(kernel_case_row(got, want, case=repr(case), bf16=case[5] == BF16))
    return rows


interpreter_run = interpreter_run_of(__file__)


def test_kernels_equal_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run) == len(CASES)
    for r in interpreter_run:
        assert r["dtypes_ok"] and r["n"] == 6, r  # out, dy, dx, dD, dz, dw
        # bf16: within a rounding of the fp32-math twin (dD and dw sum over rows)
        assert max(r["errors"]) < (1e-5 if not r["bf16"] else 3e-2), r


if __name__ == "__main__":  # python tests/test_gated_norm.py -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases()))
