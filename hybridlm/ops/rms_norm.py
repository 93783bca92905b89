"""RMSNorm, optionally after a residual add, in Triton: forward and backward.

Every block runs two of these per layer (the pre-norms of the mixer and of the MLP, with the previous sublayer's
residual add folded in: hybridlm/model/modeling.py ``_forward_residual_adds_in_norms``). fla's norm
(fla/modules/norm/layernorm.py) runs its backward at hidden sizes above 512 as one program per SM that walks its
~1,000 rows one at a time (``layer_norm_bwd_kernel_row``): a row of 1,024 channels per iteration leaves the memory
system mostly idle: the 25 norm backwards of a GDN-300M step take about five times what reading ``x``, ``dy``,
the residual's gradient and writing ``dx`` takes (BENCHMARKS.md, "Non-GEMM kernels alone", fla's norm against
the memory floor).

Here each program of the backward also loops over row blocks (one per SM times a few, for the weight gradient's
partials), but takes ``BR`` rows per iteration, so each load is ``BR`` rows wide. The forward takes ``BR`` rows per
program.

The function (fp32 math, results in the input's dtype, as fla's kernel):
``s = x + delta`` (fp32 sum, stored in x's dtype), ``y = s * rsqrt(mean(s^2) + eps) * w``. The backward
recomputes from the stored ``s`` and the fp32 ``rstd``: ``dx = rstd * (w dy - xhat * mean(xhat * w dy)) + ds``
(``ds``: the gradient reaching the returned sum), and both ``x`` and ``delta`` get ``dx``.
:func:`rms_norm_reference` is the torch twin the tests hold the kernels to.
"""
from __future__ import annotations

from typing import Optional

import torch

from hybridlm.ops.triton_launch import autotuned, interpreting, load_triton, next_power_of_2, persistent_programs

tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
_KERNELS = None
PROGRAMS_PER_SM = 4  # the backward's persistent programs (each writes one fp32 row of weight-gradient partials)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       delta: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin: ``(y, s)`` with ``s = x + delta`` (or x), fp32 math, both in x's dtype."""
    s = x.float() if delta is None else x.float() + delta.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype), s.to(x.dtype)


# ---------------------------------------------------------------------------------------------- the kernels
# Plain functions handed to triton.jit on first use (``_kernels``); ``tl`` is bound then.

def _rms_norm_fwd_kernel(x, delta, w, y, s, rstd, R, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < R
    m = m_r[:, None] & (o_d < D)[None, :]
    off = o_r[:, None].to(tl.int64) * D + o_d[None, :]
    v = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        v += tl.load(delta + off, mask=m, other=0.0).to(tl.float32)
        tl.store(s + off, v.to(s.dtype.element_ty), mask=m)
    r = 1.0 / tl.sqrt(tl.sum(v * v, 1) / D + eps)
    tl.store(rstd + o_r, r, mask=m_r)
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    tl.store(y + off, (v * r[:, None] * b_w[None, :]).to(y.dtype.element_ty), mask=m)


def _rms_norm_bwd_kernel(s, w, rstd, dy, ds, dx, dw, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                         HAS_DS: tl.constexpr):
    """Persistent: program ``p`` takes row blocks ``p, p + P, ...`` and writes its weight-gradient partial to
    ``dw[p]`` (``dw [P, D]`` fp32, summed after)."""
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(R, BR), n_prog):
        o_r = blk * BR + tl.arange(0, BR)
        m_r = o_r < R
        m = m_r[:, None] & m_d[None, :]
        off = o_r[:, None].to(tl.int64) * D + o_d[None, :]
        r = tl.load(rstd + o_r, mask=m_r, other=0.0)
        xhat = tl.load(s + off, mask=m, other=0.0).to(tl.float32) * r[:, None]
        g = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
        acc += g * xhat
        wg = g * b_w[None, :]
        d = (wg - xhat * (tl.sum(xhat * wg, 1) / D)[:, None]) * r[:, None]
        if HAS_DS:
            d += tl.load(ds + off, mask=m, other=0.0).to(tl.float32)
        tl.store(dx + off, d.to(dx.dtype.element_ty), mask=m)
    tl.store(dw + pid.to(tl.int64) * D + o_d, tl.sum(acc, 0), mask=m_d)


def _kernels():
    """``(forward, backward)``, jitted (and autotuned over rows per block and warps, on a GPU) on first use."""
    global _KERNELS
    if _KERNELS is None:
        triton = load_triton(globals())
        kernels = [triton.jit(k) for k in (_rms_norm_fwd_kernel, _rms_norm_bwd_kernel)]
        if not interpreting():  # the interpreter runs one configuration
            configs = [triton.Config({"BR": br}, num_warps=nw) for br in (1, 2, 4, 8, 16) for nw in (4, 8)]
            kernels = [autotuned(k, configs, ["D", key]) for k, key in zip(kernels, ("HAS_DELTA", "HAS_DS"))]
        _KERNELS = tuple(kernels)
    return _KERNELS


def _launch_args() -> dict:
    return {"BR": 4} if interpreting() else {}


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, weight, eps):
        shape, D = x.shape, x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        d2 = None if delta is None else delta.reshape(-1, D).contiguous()
        R = x2.shape[0]
        y = torch.empty_like(x2)
        s = torch.empty_like(x2) if d2 is not None else x2
        rstd = torch.empty(R, dtype=torch.float32, device=x.device)
        _kernels()[0][lambda meta: (-(-R // meta["BR"]),)](
            x2, d2, weight, y, s, rstd, R, eps, D=D, BD=next_power_of_2(D), HAS_DELTA=d2 is not None,
            **_launch_args())
        ctx.save_for_backward(s, weight, rstd)
        ctx.has_delta = delta is not None
        # without a delta, s is x itself: only y is returned
        return (y.view(shape), s.view(shape)) if ctx.has_delta else y.view(shape)

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, weight, rstd = ctx.saved_tensors
        R, D = s.shape
        dy2 = dy.reshape(R, D).contiguous()
        ds2 = None if ds is None else ds.reshape(R, D).contiguous()
        dx = torch.empty_like(s)
        P = persistent_programs(s.device, R, PROGRAMS_PER_SM)
        dw = torch.empty(P, D, dtype=torch.float32, device=s.device)
        _kernels()[1][(P,)](s, weight, rstd, dy2, ds2, dx, dw, R, D=D, BD=next_power_of_2(D), HAS_DS=ds2 is not None,
                            **_launch_args())
        dx = dx.view(dy.shape)
        return dx, (dx if ctx.has_delta else None), dw.sum(0).to(weight.dtype), None


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: Optional[torch.Tensor] = None):
    """``(rms_norm(s) * weight, s)`` with ``s = x + delta`` over x's last dim; ``delta=None``: just
    ``rms_norm(x) * weight``. Outputs contiguous, in x's dtype; gradients reach x, delta and weight."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"rms_norm: the residual delta must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(delta.shape)}")
    return _RMSNorm.apply(x, delta, weight, eps)
