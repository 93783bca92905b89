"""SwiGLU over one packed projection ``[..., 2F]`` (gate columns first, then up), in Triton, forward and backward.

With the MLP's gate and up projections fused into one GEMM (hybridlm/model/layers/projections.py) their outputs
are the two halves of one tensor. fla's ``swiglu`` reads such halves in place, but its backward returns the two
gradients as separate tensors, which autograd then concatenates for the GEMM's backward: a copy of ``[tokens, 2F]``
(4 GiB read and written per layer at 131k tokens and F = 4096) where the unfused MLP paid one add of
``[tokens, hidden]``. Here the backward writes both halves of the gradient into one ``[..., 2F]`` tensor.

Math in fp32, results in the input's dtype, as fla's kernels: ``z = silu(g) * u``;
``dg = dz * u * s * (1 + g * (1 - s))`` with ``s = sigmoid(g)``, ``du = dz * silu(g)``.
:func:`swiglu_packed_reference` is the torch twin the tests hold the kernels to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.triton_launch import autotuned, interpreting, load_triton, rows_view

tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
_KERNELS = None


def swiglu_packed_reference(y: torch.Tensor) -> torch.Tensor:
    """The torch twin: ``silu(g) * u`` for ``g, u = y.chunk(2, -1)``, fp32 math, output in y's dtype."""
    g, u = y.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(y.dtype)


def _gate_and_up(y, R, s_y, F_: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """This program's tile: row and column offsets, its mask, and the gate and up halves in fp32."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (o_r < R)[:, None] & (o_c < F_)[None, :]
    p = y + o_r[:, None].to(tl.int64) * s_y + o_c[None, :]
    return o_r, o_c, m, tl.load(p, mask=m, other=0.0).to(tl.float32), tl.load(p + F_, mask=m, other=0.0).to(tl.float32)


def _swiglu_packed_fwd_kernel(y, z, R, s_y, s_z, F_: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    o_r, o_c, m, g, u = _gate_and_up(y, R, s_y, F_, BR, BC)
    out = g * tl.sigmoid(g) * u
    tl.store(z + o_r[:, None].to(tl.int64) * s_z + o_c[None, :], out.to(z.dtype.element_ty), mask=m)


def _swiglu_packed_bwd_kernel(y, dz, dy, R, s_y, s_dz, s_dy, F_: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    o_r, o_c, m, g, u = _gate_and_up(y, R, s_y, F_, BR, BC)
    d = tl.load(dz + o_r[:, None].to(tl.int64) * s_dz + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    p_d = dy + o_r[:, None].to(tl.int64) * s_dy + o_c[None, :]
    tl.store(p_d, (d * u * s * (1 + g * (1 - s))).to(dy.dtype.element_ty), mask=m)
    tl.store(p_d + F_, (d * g * s).to(dy.dtype.element_ty), mask=m)


def _kernels():
    """``(forward, backward)``, jitted (and autotuned over the tile, on a GPU) on first use."""
    global _KERNELS, _gate_and_up
    if _KERNELS is None:
        triton = load_triton(globals())
        _gate_and_up = triton.jit(_gate_and_up)
        kernels = [triton.jit(k) for k in (_swiglu_packed_fwd_kernel, _swiglu_packed_bwd_kernel)]
        if not interpreting():  # the interpreter runs one configuration
            configs = [triton.Config({"BR": br, "BC": bc}, num_warps=nw)
                       for br, bc in ((1, 2048), (2, 1024), (4, 512), (8, 256), (4, 1024)) for nw in (4, 8)]
            kernels = [autotuned(k, configs, ["F_"]) for k in kernels]
        _KERNELS = tuple(kernels)
    return _KERNELS


def _launch_args() -> dict:
    return {"BR": 4, "BC": 16} if interpreting() else {}


def _grid(R: int, F_: int):
    """One program per ``[BR, BC]`` tile of the ``[R, F]`` output (and of each gradient half)."""
    return lambda meta: (-(-R // meta["BR"]), -(-F_ // meta["BC"]))


class _SwiGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        y2 = rows_view(y)
        R, F2 = y2.shape
        z = torch.empty(R, F2 // 2, dtype=y.dtype, device=y.device)
        _kernels()[0][_grid(R, F2 // 2)](y2, z, R, y2.stride(0), z.stride(0), F_=F2 // 2, **_launch_args())
        ctx.save_for_backward(y)
        return z.view(*y.shape[:-1], F2 // 2)

    @staticmethod
    def backward(ctx, dz):
        (y,) = ctx.saved_tensors
        y2, dz2 = rows_view(y), rows_view(dz)
        R, F2 = y2.shape
        dy = torch.empty(R, F2, dtype=y.dtype, device=y.device)
        _kernels()[1][_grid(R, F2 // 2)](y2, dz2, dy, R, y2.stride(0), dz2.stride(0), dy.stride(0), F_=F2 // 2,
                                          **_launch_args())
        return dy.view(y.shape)


def swiglu_packed_kernel(y: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``g, u = y.chunk(2, -1)`` (``y [..., 2F]``, last dim contiguous): output ``[..., F]``
    contiguous in y's dtype; the gradient comes back as one ``[..., 2F]`` tensor."""
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: the last dim must be 2F (gate, then up), got {y.shape[-1]}")
    return _SwiGLUPacked.apply(y)
