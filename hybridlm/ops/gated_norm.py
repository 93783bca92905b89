"""The mixers' gated output norms in one Triton kernel, forward and backward.

- Mamba2 (:func:`gated_norm_skip`): the D skip, the SiLU gate and the grouped RMSNorm,
  ``out = rms_norm_per_group((y + D_h x) * silu(z)) * w``. Through fla (``runtime.norm_kernel: fla``) that is an
  ``addcmul`` for the skip (its backward a multiply for x's gradient and a reduction for D's) and fla's grouped
  gated norm (fla/modules/layernorm_gated.py), whose backward alone takes about three times its memory traffic
  (BENCHMARKS.md, "Non-GEMM kernels alone", the Mamba2-300M output stage).
- GDN (:func:`norm_then_gate`): the per-head RMSNorm, then the gate, ``out = rms_norm_per_head(y) * w * silu(z)``,
  the heads sharing ``w``. fla's kernel for it (fla/modules/fused_norm_gate.py) first copies z, which the fused
  projection hands over as a column slice: one more read and write of z a layer (BENCHMARKS.md, "Training step
  breakdown").

The forward reads y, (x,) and z once and writes ``out`` and one fp32 ``rstd`` per row and group; the backward
recomputes the rest from those inputs and writes dy, (the skip's gradient of x,) dz, and fp32 partials of dw
(and dD), summed after.

Shapes: y, x, z ``[R, C]`` (x and z may be strided row views, e.g. slices of the projection), D ``[H]`` with
``C = H * head_dim`` (channel c belongs to head ``c // head_dim``), weight ``[C]`` (Mamba2) or ``[group_size]``
(GDN), ``C = groups * group_size``. The math is fp32, results in y's dtype. :func:`gated_norm_skip_reference` and
:func:`norm_then_gate_reference` are the torch twins the tests hold the kernels to; the models' torch paths
(hybridlm/ops/elementwise.py ``gated_rms_norm``) compute the same functions unfused.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hybridlm.ops.gradient_slots import GradientSlot, gradient_into
from hybridlm.ops.triton_launch import autotuned, interpreting, load_triton, persistent_programs, rows_view

tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
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


def norm_then_gate_reference(y, z, weight, eps: float):
    """The torch twin: ``rms_norm_per_head(y) * weight * silu(z)`` in fp32 (heads of ``weight.shape[0]``), output
    in y's dtype."""
    R, C = y.shape
    hd = weight.shape[0]
    u = y.float().view(R, C // hd, hd)
    u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (u.view(R, C) * F.silu(z.float())).to(y.dtype)


# ---------------------------------------------------------------------------------------------- the kernels
# Plain functions handed to triton.jit on first use (``_kernels``); ``tl`` is bound then. One pair of kernels
# serves both output stages: ``NORM_FIRST`` (GDN: ``norm(y) * w * silu(z)``, no skip) or not (Mamba2:
# ``norm((y + D x) * silu(z)) * w``); ``HAS_SKIP`` adds ``D x``; the weight has ``WS`` entries, channel ``c`` uses
# ``w[c % WS]`` (Mamba2: one per channel, GDN: one per head channel, shared by the heads).

def _tile(y, x, z, D, rb, grp, R, s_y, s_x, s_z, HD: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr,
          HAS_SKIP: tl.constexpr):
    """Rows ``rb * BR ...`` of group ``grp``: offsets, mask, and s = y (+ D x), z in fp32."""
    o_r = rb * BR + tl.arange(0, BR)
    o_c = grp * GS + tl.arange(0, GS)
    m = (o_r < R)[:, None]
    r64 = o_r[:, None].to(tl.int64)
    s = tl.load(y + r64 * s_y + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_SKIP:
        d = tl.load(D + o_c // HD).to(tl.float32)
        b_x = tl.load(x + r64 * s_x + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        s += b_x * d[None, :]
    else:
        d = tl.zeros([GS], dtype=tl.float32)
        b_x = tl.zeros([BR, GS], dtype=tl.float32)
    b_z = tl.load(z + r64 * s_z + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    return o_r, o_c, m, r64, d, b_x, s, b_z


def _gated_norm_fwd_kernel(y, x, z, D, w, out, rstd, R, eps, s_y, s_x, s_z, NG: tl.constexpr, HD: tl.constexpr,
                           GS: tl.constexpr, WS: tl.constexpr, NORM_FIRST: tl.constexpr, HAS_SKIP: tl.constexpr,
                           BR: tl.constexpr):
    grp = tl.program_id(1)
    o_r, o_c, m, r64, d, b_x, s, b_z = _tile(y, x, z, D, tl.program_id(0), grp, R, s_y, s_x, s_z, HD, GS, BR,
                                             HAS_SKIP)
    gate = b_z * tl.sigmoid(b_z)
    u = s if NORM_FIRST else s * gate
    r = 1.0 / tl.sqrt(tl.sum(u * u, 1) / GS + eps)
    tl.store(rstd + o_r.to(tl.int64) * NG + grp, r, mask=o_r < R)
    b_w = tl.load(w + o_c % WS).to(tl.float32)
    y_out = u * r[:, None] * b_w[None, :]
    if NORM_FIRST:
        y_out = y_out * gate
    tl.store(out + r64 * (NG * GS) + o_c[None, :], y_out.to(out.dtype.element_ty), mask=m)


def _gated_norm_bwd_kernel(y, x, z, D, w, rstd, dout, dy, dxs, dz, dw, dd, R, s_y, s_x, s_z, s_do, s_dz,
                           NG: tl.constexpr, HD: tl.constexpr, GS: tl.constexpr, WS: tl.constexpr,
                           NORM_FIRST: tl.constexpr, HAS_SKIP: tl.constexpr, BR: tl.constexpr):
    """Persistent over row blocks: program ``(p, grp)`` takes blocks ``p, p + P, ...`` of group ``grp`` and writes
    its fp32 partials ``dw[p, group's channels]`` and, with the skip, ``dd[p, group's channels]``
    (``sum_rows ds * x``). ``dz``'s rows are ``s_dz`` apart (a block of a split projection's gradient,
    hybridlm/ops/gradient_slots.py), the other outputs' contiguous."""
    pid, n_prog, grp = tl.program_id(0), tl.num_programs(0), tl.program_id(1)
    o_cg = grp * GS + tl.arange(0, GS)
    b_w = tl.load(w + o_cg % WS).to(tl.float32)
    acc_w = tl.zeros([BR, GS], dtype=tl.float32)
    acc_d = tl.zeros([BR, GS], dtype=tl.float32)
    for rb in range(pid, tl.cdiv(R, BR), n_prog):
        o_r, o_c, m, r64, d, b_x, s, b_z = _tile(y, x, z, D, rb, grp, R, s_y, s_x, s_z, HD, GS, BR, HAS_SKIP)
        sig = tl.sigmoid(b_z)
        gate = b_z * sig
        dgate = sig * (1 + b_z * (1 - sig))
        r = tl.load(rstd + o_r.to(tl.int64) * NG + grp, mask=o_r < R, other=0.0)
        g = tl.load(dout + r64 * s_do + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        gw = g * b_w[None, :]
        off = r64 * (NG * GS) + o_c[None, :]
        if NORM_FIRST:  # out = xhat * w * gate, xhat = s * r
            xhat = s * r[:, None]
            acc_w += g * xhat * gate
            wg = gw * gate
            ds = (wg - xhat * (tl.sum(xhat * wg, 1) / GS)[:, None]) * r[:, None]
            tl.store(dz + r64 * s_dz + o_c[None, :], (gw * xhat * dgate).to(dz.dtype.element_ty), mask=m)
        else:  # out = xhat * w, xhat = s * gate * r
            xhat = s * gate * r[:, None]
            acc_w += g * xhat
            du = (gw - xhat * (tl.sum(xhat * gw, 1) / GS)[:, None]) * r[:, None]
            ds = du * gate
            tl.store(dz + r64 * s_dz + o_c[None, :], (du * s * dgate).to(dz.dtype.element_ty), mask=m)
        tl.store(dy + off, ds.to(dy.dtype.element_ty), mask=m)
        if HAS_SKIP:
            acc_d += ds * b_x
            tl.store(dxs + off, (ds * d[None, :]).to(dxs.dtype.element_ty), mask=m)
    part = pid.to(tl.int64) * (NG * GS) + o_cg
    tl.store(dw + part, tl.sum(acc_w, 0))
    if HAS_SKIP:
        tl.store(dd + part, tl.sum(acc_d, 0))


def _kernels(group_size: int):
    """``(forward, backward)``, jitted (and autotuned over rows per block and warps, on a GPU) on first use, per
    group size: a block holds ``BR x group_size`` elements, 256 to 8,192 of them (GDN's groups of 64 want more
    rows per block than Mamba2's 256)."""
    global _KERNELS, _tile
    if _KERNELS is None:
        triton = load_triton(globals())
        _tile = triton.jit(_tile)
        _KERNELS = {"jit": [triton.jit(k) for k in (_gated_norm_fwd_kernel, _gated_norm_bwd_kernel)]}
    if interpreting():  # the interpreter runs one configuration
        return _KERNELS["jit"]
    if group_size not in _KERNELS:
        triton = load_triton()
        rows = [br for br in (1, 2, 4, 8, 16, 32) if 256 <= br * group_size <= 8192] or [1]
        configs = [triton.Config({"BR": br}, num_warps=nw) for br in rows for nw in (2, 4, 8)]
        _KERNELS[group_size] = [autotuned(k, configs, ["NG", "HD", "GS", "WS", "NORM_FIRST", "HAS_SKIP"])
                                for k in _KERNELS["jit"]]
    return _KERNELS[group_size]


def _launch_args() -> dict:
    return {"BR": 2} if interpreting() else {}


class _GatedNorm(torch.autograd.Function):
    """Both output stages; ``x`` and ``D`` are None without the skip."""

    @staticmethod
    def forward(ctx, y, x, D, z, weight, eps, group_size, norm_first, z_slot):
        shape, C = y.shape, y.shape[-1]
        skip = x is not None
        y2, z2 = rows_view(y), rows_view(z)
        x2 = rows_view(x) if skip else y2  # without the skip the kernels never read x or D
        R, NG = y2.shape[0], C // group_size
        out = torch.empty(R, C, dtype=y.dtype, device=y.device)
        rstd = torch.empty(R, NG, dtype=torch.float32, device=y.device)
        meta = dict(NG=NG, HD=C // D.shape[0] if skip else C, GS=group_size, WS=weight.shape[0],
                    NORM_FIRST=norm_first, HAS_SKIP=skip)
        _kernels(group_size)[0][lambda m: (-(-R // m["BR"]), NG)](
            y2, x2, z2, D if skip else weight, weight, out, rstd, R, eps, y2.stride(0), x2.stride(0), z2.stride(0),
            **meta, **_launch_args())
        ctx.save_for_backward(y2, x2, z2, D, weight, rstd)  # x2 is y2 without the skip: never read
        ctx.meta, ctx.shape, ctx.x_shape, ctx.z_shape, ctx.z_slot = meta, shape, x.shape if skip else None, \
            z.shape, z_slot
        return out.view(shape)

    @staticmethod
    def backward(ctx, dout):
        y2, x2, z2, D, weight, rstd = ctx.saved_tensors
        skip = ctx.meta["HAS_SKIP"]
        R, C = y2.shape
        do2 = rows_view(dout)
        dy = torch.empty(R, C, dtype=y2.dtype, device=y2.device)
        # z's gradient in place in the split projection's gradient where z is a block of it (gradient_slots.py)
        dz = gradient_into(ctx.z_slot, ctx.z_shape, z2.dtype, z2.device)
        dz2 = rows_view(dz)  # a slot's view keeps its rows strided: the kernel writes them in place
        dxs = torch.empty(R, C, dtype=x2.dtype, device=x2.device) if skip else dy  # not written without the skip
        NG = ctx.meta["NG"]
        P = persistent_programs(y2.device, R, PROGRAMS_PER_SM, shares=NG)
        dw = torch.empty(P, C, dtype=torch.float32, device=y2.device)
        dd = torch.empty(P, C, dtype=torch.float32, device=y2.device) if skip else dw
        _kernels(ctx.meta["GS"])[1][(P, NG)](y2, x2, z2, D if skip else weight, weight, rstd, do2, dy, dxs, dz2, dw, dd,
                                             R, y2.stride(0), x2.stride(0), z2.stride(0), do2.stride(0), dz2.stride(0),
                                             **ctx.meta, **_launch_args())
        dweight = dw.sum(0).view(-1, weight.shape[0]).sum(0)  # the heads share a GDN weight
        if not skip:
            return dy.view(ctx.shape), None, None, dz, dweight.to(weight.dtype), None, None, None, None
        dD = dd.sum(0).view(D.shape[0], -1).sum(-1)
        return (dy.view(ctx.shape), dxs.view(ctx.x_shape), dD.to(D.dtype), dz, dweight.to(weight.dtype), None, None,
                None, None)


def _check(name: str, y, z, weight, group_size: int, weight_size: int, others=()) -> None:
    C = y.shape[-1]
    if any(t.shape[-1] != C or t.numel() != y.numel() for t in (z, *others)) or weight.shape != (weight_size,):
        raise ValueError(f"{name}: y, z{', x' if others else ''} must be [..., {C}] of one size and weight "
                         f"[{weight_size}], got {tuple(y.shape)}, {tuple(z.shape)}"
                         f"{''.join(f', {tuple(t.shape)}' for t in others)}, {tuple(weight.shape)}")
    if C % group_size or group_size & (group_size - 1):
        raise ValueError(f"{name}: the {C} channels must split into groups of a power of two, got groups of "
                         f"{group_size}")


def gated_norm_skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                    eps: float, group_size: int, z_grad_slot: Optional[GradientSlot] = None) -> torch.Tensor:
    """Mamba2's ``rms_norm_per_group((y + D_h x) * silu(z)) * weight`` over the last dim (``[..., C]`` each; x and
    z may be views with strided rows), D per head ``[H]``; output contiguous in y's dtype. ``z_grad_slot``: where
    the backward writes z's gradient (hybridlm/ops/gradient_slots.py), if z is a block of a split projection."""
    C = y.shape[-1]
    _check("gated_norm_skip", y, z, weight, group_size, C, (x,))
    if C % D.shape[0]:
        raise ValueError(f"gated_norm_skip: the {C} channels must split into {D.shape[0]} heads")
    return _GatedNorm.apply(y, x, D, z, weight, eps, group_size, False, z_grad_slot)


def norm_then_gate(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   z_grad_slot: Optional[GradientSlot] = None) -> torch.Tensor:
    """GDN's ``rms_norm_per_head(y) * weight * silu(z)`` over the last dim (``[..., C]``, heads of
    ``weight.shape[0]`` channels sharing the weight; z may be a view with strided rows, as the fused projection's
    column slice is, which fla's gated norm copies first); output contiguous in y's dtype. ``z_grad_slot``: as
    :func:`gated_norm_skip`'s."""
    _check("norm_then_gate", y, z, weight, weight.shape[0], weight.shape[0])
    return _GatedNorm.apply(y, None, None, z, weight, eps, weight.shape[0], True, z_grad_slot)
