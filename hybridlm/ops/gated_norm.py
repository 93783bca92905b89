"""Mamba2's output stage in one Triton kernel, forward and backward: the D skip, the SiLU gate and the grouped
RMSNorm, ``out = rms_norm_per_group((y + D_h x) * silu(z)) * w``.

On the Triton training path these were an ``addcmul`` for the skip (its backward a multiply for x's gradient and
a reduction for D's) and fla's grouped gated norm (fla/modules/layernorm_gated.py), whose backward alone took
21.8 ms of Mamba2-300M's ~740 ms step on an H200 (1.8 ms a layer where its reads and writes are ~0.6 ms of memory
traffic; BENCHMARKS.md, "Session 18"). Here the forward reads y, x and z once and writes ``out`` and one fp32
``rstd`` per row and group; the backward recomputes the rest from those inputs and writes dy, the skip's
gradient of x, dz, and fp32 partials of dD and dw (summed after).

Shapes: y, x, z ``[R, C]`` (x and z may be strided row views, e.g. slices of the projection), D ``[H]`` with
``C = H * head_dim`` (channel c belongs to head ``c // head_dim``), weight ``[C]``, ``C = groups * group_size``.
The math is fp32, results in y's dtype. :func:`gated_norm_skip_reference` is the torch twin the tests hold the
kernels to; the model's torch path (hybridlm/model/layers/mamba2.py) computes the same function unfused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.triton_launch import interpreting, persistent_programs, rows_view

tl = None  # bound on first use (triton is imported lazily, as fla is: hybridlm/ops/backend.py)
_KERNELS = None
PROGRAMS_PER_SM = 4  # the backward's persistent programs over all groups (each writes fp32 partials)


def gated_norm_skip_reference(y, x, D, z, weight, eps: float, group_size: int):
    """The torch twin: ``rms_norm_per_group((y + D_h x) * silu(z)) * weight`` in fp32, output in y's dtype."""
    R, C = y.shape
    head_dim = C // D.shape[0]
    s = y.float() + x.float() * D.float().repeat_interleave(head_dim)
    u = (s * F.silu(z.float())).view(R, C // group_size, group_size)
    u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    return (u.view(R, C) * weight.float()).to(y.dtype)


# ---------------------------------------------------------------------------------------------- the kernels
# Plain functions handed to triton.jit on first use (``_kernels``); ``tl`` is bound then.

def _tile(y, x, z, D, rb, grp, R, s_y, s_x, s_z, HD: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr):
    """Rows ``rb * BR ...`` of group ``grp``: offsets, mask, and s = y + D x, z in fp32."""
    o_r = rb * BR + tl.arange(0, BR)
    o_c = grp * GS + tl.arange(0, GS)
    m = (o_r < R)[:, None]
    r64 = o_r[:, None].to(tl.int64)
    d = tl.load(D + o_c // HD).to(tl.float32)
    b_x = tl.load(x + r64 * s_x + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(y + r64 * s_y + o_c[None, :], mask=m, other=0.0).to(tl.float32) + b_x * d[None, :]
    b_z = tl.load(z + r64 * s_z + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    return o_r, o_c, m, r64, d, b_x, s, b_z


def _gated_norm_fwd_kernel(y, x, z, D, w, out, rstd, R, eps, s_y, s_x, s_z, NG: tl.constexpr, HD: tl.constexpr,
                           GS: tl.constexpr, BR: tl.constexpr):
    grp = tl.program_id(1)
    o_r, o_c, m, r64, d, b_x, s, b_z = _tile(y, x, z, D, tl.program_id(0), grp, R, s_y, s_x, s_z, HD, GS, BR)
    u = s * b_z * tl.sigmoid(b_z)
    r = 1.0 / tl.sqrt(tl.sum(u * u, 1) / GS + eps)
    tl.store(rstd + o_r.to(tl.int64) * NG + grp, r, mask=o_r < R)
    b_w = tl.load(w + o_c).to(tl.float32)
    tl.store(out + r64 * (NG * GS) + o_c[None, :], (u * r[:, None] * b_w[None, :]).to(out.dtype.element_ty),
             mask=m)


def _gated_norm_bwd_kernel(y, x, z, D, w, rstd, dout, dy, dxs, dz, dw, dd, R, s_y, s_x, s_z, s_do,
                           NG: tl.constexpr, HD: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr):
    """Persistent over row blocks: program ``(p, grp)`` takes blocks ``p, p + P, ...`` of group ``grp`` and writes
    its fp32 partials ``dw[p, group's channels]`` and ``dd[p, group's channels]`` (``sum_rows ds * x``)."""
    pid, n_prog, grp = tl.program_id(0), tl.num_programs(0), tl.program_id(1)
    o_cg = grp * GS + tl.arange(0, GS)
    b_w = tl.load(w + o_cg).to(tl.float32)
    acc_w = tl.zeros([BR, GS], dtype=tl.float32)
    acc_d = tl.zeros([BR, GS], dtype=tl.float32)
    for rb in range(pid, tl.cdiv(R, BR), n_prog):
        o_r, o_c, m, r64, d, b_x, s, b_z = _tile(y, x, z, D, rb, grp, R, s_y, s_x, s_z, HD, GS, BR)
        sig = tl.sigmoid(b_z)
        gate = b_z * sig
        r = tl.load(rstd + o_r.to(tl.int64) * NG + grp, mask=o_r < R, other=0.0)
        xhat = s * gate * r[:, None]
        g = tl.load(dout + r64 * s_do + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        acc_w += g * xhat
        wg = g * b_w[None, :]
        du = (wg - xhat * (tl.sum(xhat * wg, 1) / GS)[:, None]) * r[:, None]
        ds = du * gate
        acc_d += ds * b_x
        off = r64 * (NG * GS) + o_c[None, :]
        tl.store(dy + off, ds.to(dy.dtype.element_ty), mask=m)
        tl.store(dxs + off, (ds * d[None, :]).to(dxs.dtype.element_ty), mask=m)
        tl.store(dz + off, (du * s * sig * (1 + b_z * (1 - sig))).to(dz.dtype.element_ty), mask=m)
    part = pid.to(tl.int64) * (NG * GS) + o_cg
    tl.store(dw + part, tl.sum(acc_w, 0))
    tl.store(dd + part, tl.sum(acc_d, 0))


def _kernels():
    """``(forward, backward)``, jitted (and autotuned over rows per block and warps, on a GPU) on first use."""
    global _KERNELS, tl, _tile
    if _KERNELS is None:
        import triton
        import triton.language as tl  # noqa: F811 -- binds the module global the kernels' source names
        _tile = triton.jit(_tile)
        kernels = [triton.jit(k) for k in (_gated_norm_fwd_kernel, _gated_norm_bwd_kernel)]
        if not interpreting():  # the interpreter runs one configuration
            configs = [triton.Config({"BR": br}, num_warps=nw) for br in (1, 2, 4, 8) for nw in (2, 4, 8)]
            kernels = [triton.autotune(configs, key=["NG", "HD", "GS"])(k) for k in kernels]
        _KERNELS = tuple(kernels)
    return _KERNELS


def _launch_args() -> dict:
    return {"BR": 2} if interpreting() else {}


class _GatedNormSkip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x, D, z, weight, eps, group_size):
        shape, C = y.shape, y.shape[-1]
        y2, x2, z2 = rows_view(y), rows_view(x), rows_view(z)
        R, NG = y2.shape[0], C // group_size
        out = torch.empty(R, C, dtype=y.dtype, device=y.device)
        rstd = torch.empty(R, NG, dtype=torch.float32, device=y.device)
        meta = dict(NG=NG, HD=C // D.shape[0], GS=group_size)
        _kernels()[0][lambda m: (-(-R // m["BR"]), NG)](
            y2, x2, z2, D, weight, out, rstd, R, eps, y2.stride(0), x2.stride(0), z2.stride(0), **meta,
            **_launch_args())
        ctx.save_for_backward(y2, x2, z2, D, weight, rstd)
        ctx.meta, ctx.shape, ctx.x_shape = meta, shape, x.shape
        return out.view(shape)

    @staticmethod
    def backward(ctx, dout):
        y2, x2, z2, D, weight, rstd = ctx.saved_tensors
        R, C = y2.shape
        do2 = rows_view(dout)
        dy, dxs, dz = (torch.empty(R, C, dtype=t.dtype, device=t.device) for t in (y2, x2, z2))
        NG = ctx.meta["NG"]
        P = persistent_programs(y2.device, R, PROGRAMS_PER_SM, shares=NG)
        dw = torch.empty(P, C, dtype=torch.float32, device=y2.device)
        dd = torch.empty(P, C, dtype=torch.float32, device=y2.device)
        _kernels()[1][(P, NG)](y2, x2, z2, D, weight, rstd, do2, dy, dxs, dz, dw, dd, R, y2.stride(0), x2.stride(0),
                               z2.stride(0), do2.stride(0), **ctx.meta, **_launch_args())
        dD = dd.sum(0).view(D.shape[0], -1).sum(-1)
        return (dy.view(ctx.shape), dxs.view(ctx.x_shape), dD.to(D.dtype), dz.view(ctx.shape),
                dw.sum(0).to(weight.dtype), None, None)


def gated_norm_skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                    eps: float, group_size: int) -> torch.Tensor:
    """``rms_norm_per_group((y + D_h x) * silu(z)) * weight`` over the last dim (``[..., C]`` each; x and z may be
    views with strided rows), D per head ``[H]``; output contiguous in y's dtype."""
    C = y.shape[-1]
    if x.shape[-1] != C or z.shape[-1] != C or weight.shape != (C,) or x.numel() != y.numel() or \
            z.numel() != y.numel():
        raise ValueError(f"gated_norm_skip: y, x, z must be [..., {C}] of one size and weight [{C}], got "
                         f"{tuple(y.shape)}, {tuple(x.shape)}, {tuple(z.shape)}, {tuple(weight.shape)}")
    if C % group_size or C % D.shape[0] or group_size & (group_size - 1):
        raise ValueError(f"gated_norm_skip: the {C} channels must split into {D.shape[0]} heads and into groups "
                         f"of a power of two, got groups of {group_size}")
    return _GatedNormSkip.apply(y, x, D, z, weight, eps, group_size)
