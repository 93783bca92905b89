"""The cross-entropy kernel (hybridlm/ops/cross_entropy.py), CPU.

1. Its torch twin against torch's ``cross_entropy`` and autograd (per-row losses; the gradient of the scaled sum).
2. The Triton kernel through the interpreter (``TRITON_INTERPRET=1``, a subprocess) against the twin: losses,
   the gradient written over the logits (fp32 to ~1e-6, bf16 within a rounding), and the logits left untouched
   without ``write_grad``. Cases cover a vocabulary that is not a multiple of the sweep block, ignored rows,
   labels on the first and last column, and large logits (the online max must not overflow).
The chunked loss that calls it is tested in tests/test_model.py (through the interpreter); the compiled kernel
on a GPU in tests/gpu/test_loss_and_norm_kernels_gpu.py.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import interpreter_rounds_like_gpu, interpreter_run_of, max_rel_err
from hybridlm.ops.cross_entropy import cross_entropy_reference

# (rows, vocab, dtype, logit scale)
CASES = [(9, 50, torch.float32, 1.0), (6, 33, torch.float32, 40.0), (7, 64, torch.bfloat16, 3.0)]


def _inputs(case, seed):
    R, V, dtype, scale = case
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * scale).to(dtype)
    target = torch.randint(0, V, (R,), generator=g)
    target[0], target[1], target[2] = -100, 0, V - 1
    inv_n = torch.tensor(1.0 / (target != -100).sum().item())
    return logits, target, inv_n


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_twin_equals_torch_cross_entropy_and_its_gradient(case):
    logits, target, inv_n = _inputs(case, 0)
    losses, grad = cross_entropy_reference(logits, target, inv_n)
    leaf = logits.clone().requires_grad_(True)
    want = F.cross_entropy(leaf, target, ignore_index=-100, reduction="none")
    (want.sum() * inv_n).backward()
    torch.testing.assert_close(losses, want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-5, atol=1e-6)
    assert losses[0] == 0 and grad[0].abs().max() == 0  # the ignored row


def run_kernel_cases() -> list:
    from hybridlm.ops.cross_entropy import cross_entropy_kernel
    interpreter_rounds_like_gpu()
    rows = []
    for seed, case in enumerate(CASES):
        logits, target, inv_n = _inputs(case, seed)
        want_losses, want_grad = cross_entropy_reference(logits, target, inv_n)
        kept = logits.clone()
        only_losses = cross_entropy_kernel(kept, target, inv_n, write_grad=False)
        buf = logits.clone()
        losses = cross_entropy_kernel(buf, target, inv_n, write_grad=True)
        rows.append({"case": repr(case), "bf16": case[2] == torch.bfloat16,
                     "loss_err": max_rel_err(losses, want_losses),
                     "loss_only_err": max_rel_err(only_losses, want_losses),
                     "grad_err": max_rel_err(buf, want_grad) / max(1e-30, want_grad.abs().max().item()),
                     "untouched": bool(torch.equal(kept, logits)), "dtype_ok": buf.dtype == logits.dtype,
                     "ignored_row_zero": bool(losses[0] == 0 and buf[0].abs().max() == 0)})
    return rows


interpreter_run = interpreter_run_of(__file__)


def test_kernel_equals_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run) == len(CASES)
    for r in interpreter_run:
        assert r["untouched"] and r["dtype_ok"] and r["ignored_row_zero"], r
        assert max(r["loss_err"], r["loss_only_err"]) < 1e-6, r
        # the gradient relative to its largest entry: fp32 to ~1e-6; bf16 within a rounding
        assert r["grad_err"] < (1e-5 if not r["bf16"] else 1e-2), r


def test_bad_logits_are_named():
    from hybridlm.ops.cross_entropy import cross_entropy_kernel
    with pytest.raises(ValueError, match="logits must be \\[R, V\\]"):
        cross_entropy_kernel(torch.randn(4, 8).t(), torch.zeros(8, dtype=torch.long), torch.tensor(1.0), True)


if __name__ == "__main__":  # python tests/test_cross_entropy.py -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases()))
