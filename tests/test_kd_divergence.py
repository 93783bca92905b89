"""The KD divergence kernel (hybridlm/ops/kd_divergence.py), CPU.

1. Its torch twin against autograd through the KD loss's own torch ops (distill/kd_loss.py ``KDChunk``): per-row
   KL and CE, and the gradient of ``scale * (kl_weight * KL + ce_weight * CE)``.
2. The Triton kernel through the interpreter (``TRITON_INTERPRET=1``, a subprocess) against the twin: KL, CE, the
   gradient written over the student's logits (fp32 to ~1e-5, bf16 within a rounding), and the logits left
   untouched without ``write_grad``. Cases: a vocabulary that is not a multiple of the sweep block, temperature 1
   and 2, CE weight 0 and not, labels on the first and last column, and large logits (the online maxima).
3. ``kd_loss`` with the kernel equals ``kd_loss`` with torch ops: loss, metrics and both gradients.
The compiled kernel on a GPU: tests/gpu/test_loss_and_norm_kernels_gpu.py.
"""
import json

import pytest
import torch

from conftest import interpreter_rounds_like_gpu, interpreter_run_of, max_rel_err
from hybridlm.ops.kd_divergence import kd_divergence_reference

# (rows, vocab, dtype, logit scale, temperature, kl_weight, ce_weight)
CASES = [(9, 50, torch.float32, 1.0, 1.0, 1.0, 0.0), (6, 33, torch.float32, 30.0, 2.0, 0.7, 0.3),
         (7, 64, torch.bfloat16, 3.0, 1.0, 1.0, 0.5)]


def _inputs(case, seed):
    R, V, dtype, scale = case[:4]
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(R, V, generator=g) * scale).to(dtype)
    teacher = (torch.randn(R, V, generator=g) * scale).to(dtype)
    target = torch.randint(0, V, (R,), generator=g)
    target[0], target[1] = 0, V - 1
    return student, teacher, target


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_twin_equals_the_kd_chunk_and_autograd(case):
    from distill.kd_loss import KDChunk
    student, teacher, target = _inputs(case, 0)
    temperature, kl_w, ce_w = case[4:]
    scale = 1.0 / student.shape[0]
    kl, ce, grad = kd_divergence_reference(student, teacher, target, temperature, kl_w, ce_w, scale)
    # the KD loss's torch ops, with the teacher's logits as an identity head over its "hidden states"
    eye = torch.eye(student.shape[1])
    chunk = KDChunk(teacher, eye, target, temperature, kl_w, ce_w)
    loss, g = chunk(student.clone(), slice(0, student.shape[0]), True)
    torch.testing.assert_close(chunk.kl_sum, kl.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunk.ce_sum, ce.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, grad, rtol=1e-5, atol=1e-7)
    leaf = student.clone().requires_grad_(True)
    log_ps = torch.log_softmax(leaf / temperature, -1)
    log_pt = torch.log_softmax(teacher / temperature, -1)
    kl_auto = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    ce_auto = torch.nn.functional.cross_entropy(leaf, target, reduction="none")
    (scale * (kl_w * kl_auto + ce_w * ce_auto).sum()).backward()
    torch.testing.assert_close(kl, kl_auto.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, scale * (kl_w * kl.sum() + ce_w * ce.sum()), rtol=1e-5, atol=1e-6)


def run_kernel_cases() -> list:
    from hybridlm.ops.kd_divergence import kd_divergence_kernel
    interpreter_rounds_like_gpu()
    rows = []
    for seed, case in enumerate(CASES):
        student, teacher, target = _inputs(case, seed)
        temperature, kl_w, ce_w = case[4:]
        scale = 1.0 / student.shape[0]
        want_kl, want_ce, want_grad = kd_divergence_reference(student, teacher, target, temperature, kl_w, ce_w,
                                                              scale)
        kept = student.clone()
        kl_only, ce_only = kd_divergence_kernel(kept, teacher, target, temperature, kl_w, ce_w, scale, False)
        buf = student.clone()
        kl, ce = kd_divergence_kernel(buf, teacher, target, temperature, kl_w, ce_w, scale, True)
        rows.append({"case": repr(case), "bf16": case[2] == torch.bfloat16,
                     "kl_err": max(max_rel_err(kl, want_kl), max_rel_err(kl_only, want_kl)),
                     "kl_abs": (kl - want_kl).abs().max().item(),
                     "ce_err": max(max_rel_err(ce, want_ce), max_rel_err(ce_only, want_ce)),
                     "grad_err": max_rel_err(buf, want_grad) / max(1e-30, want_grad.abs().max().item()),
                     "untouched": bool(torch.equal(kept, student)), "dtype_ok": buf.dtype == student.dtype})
    rows.append(chunked_kd_both_ways())
    return rows


def chunked_kd_both_ways() -> dict:
    """The chunked head (hybridlm/model/loss.py) with KD's chunk on the kernel and on torch ops: one record."""
    from distill.kd_loss import KDChunk
    from hybridlm.model.loss import ChunkedLinearHead
    g = torch.Generator().manual_seed(5)
    n, d, V = 11, 8, 40
    hs, ws = torch.randn(n, d, generator=g), torch.randn(V, d, generator=g)
    ht, wt = torch.randn(n, d, generator=g), torch.randn(V, d, generator=g)
    target = torch.randint(0, V, (n,), generator=g)
    out = {}
    for triton in (False, True):
        h, w = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
        chunk = KDChunk(ht, wt, target, 1.5, 0.8, 0.2, triton=triton)
        loss = ChunkedLinearHead.apply(h, w, chunk, 4, True)
        loss.backward()
        out[triton] = (loss.detach(), chunk.kl_sum, chunk.ce_sum, h.grad, w.grad)
    errs = [max_rel_err(a, b) for a, b in zip(out[True], out[False])]
    return {"case": "chunked kd_loss, kernel against torch ops", "chunked_err": max(errs)}


interpreter_run = interpreter_run_of(__file__)


def test_kernel_equals_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run) == len(CASES) + 1
    *cases, chunked = interpreter_run
    assert chunked["chunked_err"] < 1e-5, chunked  # loss, KL and CE sums, both gradients
    for r in cases:
        assert r["untouched"] and r["dtype_ok"], r
        # KL near 0 is a difference of log-sum-exps: held to its absolute error too
        assert r["kl_err"] < 1e-5 or r["kl_abs"] < 1e-5, r
        assert r["ce_err"] < 1e-5, r
        assert r["grad_err"] < (1e-5 if not r["bf16"] else 1e-2), r


def test_bad_logits_are_named():
    from hybridlm.ops.kd_divergence import kd_divergence_kernel
    with pytest.raises(ValueError, match=r"kd_divergence: student and teacher logits must be \[R, V\]"):
        kd_divergence_kernel(torch.randn(4, 8), torch.randn(4, 9), torch.zeros(4, dtype=torch.long), 1.0, 1.0, 0.0,
                             1.0, True)


if __name__ == "__main__":  # python tests/test_kd_divergence.py -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases()))
