"""The RMSNorm kernels (hybridlm/ops/rms_norm.py), CPU.

1. Its torch twin against the model's torch path (``rms_norm`` / ``add_rms_norm`` of hybridlm/ops/elementwise.py,
   what every block runs on CPU) and against the written formula: outputs, and gradients of x, delta and weight.
2. The Triton forward and backward kernels through the interpreter (``TRITON_INTERPRET=1``, a subprocess) against
   the twin: fp32 to ~1e-5, bf16 within a rounding. Cases cover rows that do not fill the last row block, more
   row blocks than backward programs (each program's loop strides), widths that are not a power of two, with and
   without the residual delta, and a gradient reaching the returned sum or not.
The GPU twin of this test (compiled kernels against the twin and fla's norm) is
tests/gpu/test_loss_and_norm_kernels_gpu.py.
"""
import json

import pytest
import torch

from conftest import interpreter_rounds_like_gpu, interpreter_run_of, kernel_case_row
from hybridlm.ops.elementwise import add_rms_norm, rms_norm
from hybridlm.ops.rms_norm import rms_norm_reference

F32, BF16 = torch.float32, torch.bfloat16
# (leading shape, width, delta, gradient into the sum, dtype)
CASES = [
    ((2, 7), 24, True, True, F32),      # 14 rows: 4 blocks of 4 over 3 programs, the last block partial
    ((13,), 40, False, False, F32),     # no delta: y only
    ((3, 5), 32, True, False, F32),     # the sum returned but its gradient unused
    ((1,), 64, True, True, F32),        # one row
    ((2, 9), 48, True, True, BF16),
    ((11,), 20, False, False, BF16),
]
EPS = 1e-6


def _inputs(case, seed):
    lead, D, has_delta, grad_sum, dtype = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, generator=g).to(dtype)
    delta = torch.randn(*lead, D, generator=g).to(dtype) if has_delta else None
    weight = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    dy = torch.randn(*lead, D, generator=g).to(dtype)
    ds = torch.randn(*lead, D, generator=g).to(dtype) if grad_sum else None
    return x, delta, weight, dy, ds


def _grads(fn, x, delta, weight, dy, ds):
    """``fn(x, weight, delta) -> (y, s)`` (s None without delta): outputs and the leaves' gradients."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (x, delta, weight)]
    y, s = fn(leaves[0], leaves[2], leaves[1])
    loss = (y.float() * dy.float()).sum()
    if ds is not None:
        loss = loss + (s.float() * ds.float()).sum()
    loss.backward()
    out = [y.detach()] + ([] if s is None else [s.detach()])
    return out + [t.grad for t in leaves if t is not None]


def _twin(x, weight, delta):
    y, s = rms_norm_reference(x, weight, EPS, delta)
    return y, (s if delta is not None else None)


def _torch_path(x, weight, delta):
    if delta is None:
        return rms_norm(x, weight, EPS), None
    return add_rms_norm(x, delta, weight, EPS)


def _formula(x, weight, delta):
    s = x.double() if delta is None else x.double() + delta.double()
    y = s / torch.sqrt((s * s).sum(-1, keepdim=True) / s.shape[-1] + EPS) * weight.double()
    return y.to(x.dtype), (None if delta is None else s.to(x.dtype))


@pytest.mark.parametrize("case", [c for c in CASES if c[4] == F32], ids=str)
def test_twin_equals_the_torch_path_and_the_formula(case):
    x, delta, weight, dy, ds = _inputs(case, 0)
    twin = _grads(_twin, x, delta, weight, dy, ds)
    for other in (_torch_path, _formula):
        got = _grads(other, x, delta, weight, dy, ds)
        assert len(got) == len(twin)
        for a, b in zip(twin, got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_decode_steps_rows_keep_fla_s_kernel():
    """The project's kernel runs in training and on long inference inputs; a decode step's few rows (no autograd)
    keep fla's, with which the captured decode step was measured."""
    from hybridlm.ops.backend import SMALL_CALL_ROWS
    from hybridlm.ops.elementwise import _project_norm
    step, prompt = torch.randn(4, 1, 64), torch.randn(2, SMALL_CALL_ROWS, 64)
    assert _project_norm(step, "project") and _project_norm(prompt, "project")  # grad mode on: training
    with torch.no_grad():
        assert not _project_norm(step, "project") and _project_norm(prompt, "project")
        assert not _project_norm(prompt, "fla")  # runtime.norm_kernel: fla


def test_bad_shapes_are_named():
    x = torch.randn(3, 8)
    from hybridlm.ops.rms_norm import rms_norm_kernel
    with pytest.raises(ValueError, match="weight must be \\[8\\]"):
        rms_norm_kernel(x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="delta must have x's shape"):
        rms_norm_kernel(x, torch.ones(8), EPS, delta=torch.randn(3, 4))


def run_kernel_cases() -> list:
    from hybridlm.ops.rms_norm import rms_norm_kernel
    interpreter_rounds_like_gpu()

    def kernel(x, weight, delta):
        out = rms_norm_kernel(x, weight, EPS, delta)
        return out if delta is not None else (out, None)

    rows = []
    for seed, case in enumerate(CASES):
        x, delta, weight, dy, ds = _inputs(case, seed)
        want = _grads(_twin, x, delta, weight, dy, ds)
        got = _grads(kernel, x, delta, weight, dy, ds)
        rows.append(kernel_case_row(got, want, case=repr(case), bf16=case[4] == BF16))
    return rows


interpreter_run = interpreter_run_of(__file__)


def test_kernels_equal_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run) == len(CASES)
    for r in interpreter_run:
        # y (, s), dx (, d delta), dw
        assert r["dtypes_ok"] and r["n"] == r["n_want"] and r["n"] in (3, 5), r
        # bf16: within a rounding of the fp32-math twin (dw sums over the rows)
        assert max(r["errors"]) < (1e-5 if not r["bf16"] else 2e-2), r


if __name__ == "__main__":  # python tests/test_rms_norm.py -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases()))
