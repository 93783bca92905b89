"""KD's per-row KL and cross-entropy and their gradient over one chunk of logits, in one Triton kernel.

KD (distill/kd_loss.py) needs, per chunk of ``[rows, vocab]`` student logits ``s`` and teacher logits ``t``, each
row's ``KL(softmax(t/T) || softmax(s/T))`` and cross-entropy ``CE(s, y)``, and the gradient of
``scale * (kl_weight * KL + ce_weight * CE)`` with respect to ``s``:
``scale * (kl_weight / T * (softmax(s/T) - softmax(t/T)) + ce_weight * (softmax(s) - onehot(y)))``.
In torch ops that is about a dozen full passes over the chunk in fp32 (the casts, two log-softmaxes, the KL's
product and sum, the gradient's exp / sub / mul, CE's own exp): the chunk's ``rows x vocab`` fp32 values read and
written several times.

Here one program per row makes one sweep over both rows of logits, keeping per lane the online maxima and sums
for ``s/T``, ``t/T`` and (when ``T != 1``) ``s``, and the teacher-weighted ``sum exp(t/T - m) * (t - s) / T``, from
which ``KL = sum p_t (t - s) / T + lse(s/T) - lse(t/T)``. A second sweep writes the gradient over ``s`` in place.

:func:`kd_divergence_reference` is the torch twin the tests hold the kernel to (tests/test_kd_divergence.py).
"""
from __future__ import annotations

import torch

from hybridlm.ops.triton_launch import interpreting, load_triton

tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
_KERNEL = None
# as the cross-entropy kernel's (hybridlm/ops/cross_entropy.py): not autotuned, since the kernel writes over its
# input; the same block and warps
BLOCK_V, NUM_WARPS = 2048, 4


def kd_divergence_reference(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float,
                            kl_weight: float, ce_weight: float, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin: per-row ``KL(softmax(t/T) || softmax(s/T))`` and ``CE(s, y)`` (fp32) and the gradient of
    ``scale * sum(kl_weight * KL + ce_weight * CE)`` with respect to ``s``, in ``s``'s dtype; fp32 math."""
    inv_t = 1.0 / float(temperature)
    s, t = student.float(), teacher.float()
    log_ps = torch.log_softmax(s * inv_t, dim=-1)
    log_pt = torch.log_softmax(t * inv_t, dim=-1)
    pt = log_pt.exp()
    kl = (pt * (log_pt - log_ps)).sum(-1)
    log_p1 = torch.log_softmax(s, dim=-1)
    ce = -log_p1.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    onehot = torch.zeros_like(s).scatter_(-1, target.unsqueeze(-1), 1.0)
    grad = scale * (kl_weight * inv_t * (log_ps.exp() - pt) + ce_weight * (log_p1.exp() - onehot))
    return kl, ce, grad.to(student.dtype)


def _kd_divergence_kernel(s_ptr, t_ptr, target, kl_out, ce_out, V, s_row, t_row, inv_t, kl_grad, ce_grad,
                          BV: tl.constexpr, TEMPERED: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ps = s_ptr + row * s_row
    pt = t_ptr + row * t_row
    o = tl.arange(0, BV)
    # sweep 1, per lane: running maxima and sums of exp for s/T (a) and t/T (b), the b-weighted sum of (b - a),
    # and with T != 1 those of s itself (for CE); finite starts so that an all-masked lane stays 0
    ma = tl.full([BV], -1e30, dtype=tl.float32)
    mb = tl.full([BV], -1e30, dtype=tl.float32)
    m1 = tl.full([BV], -1e30, dtype=tl.float32)
    sa = tl.zeros([BV], dtype=tl.float32)
    sb = tl.zeros([BV], dtype=tl.float32)
    s1 = tl.zeros([BV], dtype=tl.float32)
    wb = tl.zeros([BV], dtype=tl.float32)
    for v0 in range(0, V, BV):
        mask = v0 + o < V
        x = tl.load(ps + v0 + o, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(pt + v0 + o, mask=mask, other=0.0).to(tl.float32)
        a = tl.where(mask, x * inv_t, float("-inf"))
        b = tl.where(mask, y * inv_t, float("-inf"))
        ma_new = tl.maximum(ma, a)
        sa = sa * tl.exp(ma - ma_new) + tl.exp(a - ma_new)
        ma = ma_new
        mb_new = tl.maximum(mb, b)
        rescale = tl.exp(mb - mb_new)
        eb = tl.exp(b - mb_new)
        sb = sb * rescale + eb
        wb = wb * rescale + tl.where(mask, eb * (y - x) * inv_t, 0.0)
        mb = mb_new
        if TEMPERED:
            x1 = tl.where(mask, x, float("-inf"))
            m1_new = tl.maximum(m1, x1)
            s1 = s1 * tl.exp(m1 - m1_new) + tl.exp(x1 - m1_new)
            m1 = m1_new
    ma_row = tl.max(ma, 0)
    lse_a = ma_row + tl.log(tl.sum(sa * tl.exp(ma - ma_row), 0))
    mb_row = tl.max(mb, 0)
    lane_b = tl.exp(mb - mb_row)
    sum_b = tl.sum(sb * lane_b, 0)
    lse_b = mb_row + tl.log(sum_b)
    kl = tl.sum(wb * lane_b, 0) / sum_b + lse_a - lse_b
    if TEMPERED:
        m1_row = tl.max(m1, 0)
        lse_1 = m1_row + tl.log(tl.sum(s1 * tl.exp(m1 - m1_row), 0))
    else:
        lse_1 = lse_a
    label = tl.load(target + row)
    x_label = tl.load(ps + label).to(tl.float32)
    tl.store(kl_out + row, kl)
    tl.store(ce_out + row, lse_1 - x_label)
    if WRITE_GRAD:
        # sweep 2: kl_grad * (softmax(s/T) - softmax(t/T)) + ce_grad * (softmax(s) - onehot), over s in place
        for v0 in range(0, V, BV):
            cols = v0 + o
            mask = cols < V
            x = tl.load(ps + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(pt + cols, mask=mask, other=0.0).to(tl.float32)
            g = kl_grad * (tl.exp(x * inv_t - lse_a) - tl.exp(y * inv_t - lse_b))
            g += ce_grad * (tl.exp(x - lse_1) - tl.where(cols == label, 1.0, 0.0))
            tl.store(ps + cols, g.to(s_ptr.dtype.element_ty), mask=mask)


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        triton = load_triton(globals())
        _KERNEL = triton.jit(_kd_divergence_kernel)
    return _KERNEL


def kd_divergence_kernel(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float,
                         kl_weight: float, ce_weight: float, scale: float, write_grad: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL and CE (fp32) of ``student [R, V]`` logits against ``teacher [R, V]`` logits (rows contiguous)
    and ``target [R]`` (every row supervised). With ``write_grad`` the student's logits are overwritten by the
    gradient of ``scale * sum(kl_weight * KL + ce_weight * CE)`` with respect to them, so the caller must own them."""
    if (student.dim() != 2 or student.shape != teacher.shape or student.stride(-1) != 1 or teacher.stride(-1) != 1
            or target.shape != student.shape[:1]):
        raise ValueError(f"kd_divergence: student and teacher logits must be [R, V] with contiguous rows and target "
                         f"[R], got {tuple(student.shape)}, {tuple(teacher.shape)} and {tuple(target.shape)}")
    R, V = student.shape
    kl = torch.empty(R, dtype=torch.float32, device=student.device)
    ce = torch.empty(R, dtype=torch.float32, device=student.device)
    inv_t = 1.0 / float(temperature)
    block, warps = (16, 1) if interpreting() else (BLOCK_V, NUM_WARPS)
    _kernel()[(R,)](student, teacher, target.contiguous(), kl, ce, V, student.stride(0), teacher.stride(0), inv_t,
                    float(scale * kl_weight * inv_t), float(scale * ce_weight), BV=block, TEMPERED=inv_t != 1.0,
                    WRITE_GRAD=write_grad, num_warps=warps)
    return kl, ce
