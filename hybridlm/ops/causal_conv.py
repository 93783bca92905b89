"""Depthwise causal short convolution (+ SiLU) without a state, in Triton: forward and a two-pass backward.

The training path of every recurrent mixer runs one such conv per layer (Mamba2 over ``[x | B | C]``, 3,072
channels at 300M; GDN / KDA over q, k and v). fla's ``causal_conv1d`` (fla/modules/causal_conv1d/ops.py) first
recomputes the forward into a new tensor, then one kernel reads that tensor and ``dy`` once per tap and writes the
weight gradient as one fp32 row per tile and tap. On an H200 that backward took 41 ms of Mamba2-300M's 756 ms step
(12 layers of [64, 2048, 3072]; 3.4 ms a layer where reading x and dy and writing dx is ~0.5 ms of memory traffic).

:func:`causal_conv` computes the same function (``silu(b + sum_i w[:, i] x[t - W + 1 + i])``, fp32 sums in fla's
tap order). Backward, pass 1 per ``[BT, BD]`` tile (a program takes :func:`pass1_tiles` of them in time): the
pre-activation from ``x`` (its shifted tiles come from cache), ``da = dy * silu'(pre)`` stored in dy's dtype, and
fp32 partials of ``dw`` and ``db`` from the same x tiles, accumulated element-wise and summed over time once per
program (one row per program, summed after); pass 2: ``dx``, the transposed conv of ``da``. A first version did
it in one pass, recomputing the pre-activation of the ``W - 1`` following rows for every tap instead of storing
``da``: at the Mamba2 shape it was slower than fla's (BENCHMARKS.md, "Session 17").

:func:`causal_conv_reference` is the torch twin the tests hold the kernels to (through Triton's interpreter on
CPU, compiled on GPU). No cached state: generation's conv continues from a state through
``hybridlm.ops.elementwise.short_conv_with_state``, which prepends the state and calls this.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hybridlm.ops.triton_launch import autotuned, interpreting, next_power_of_2

BT = 64  # rows of time per tile (fixed: the partial-gradient buffers are sized by it)
# time tiles per program of the backward's pass 1, whose fp32 weight-gradient partials (one row per program) are
# summed after: more tiles, fewer partials to write and fewer sums over time, but fewer programs. 0 picks by width:
# measured on an H200 at [64, 2048, D] (BENCHMARKS.md, "Session 19"), 32 tiles were fastest at D = 512 and 3,072,
# one tile at D = 256 (its grid too small otherwise). scripts/device/kernel_bench.py --conv-tiles sweeps it.
TILES_PER_PROGRAM = 0
WIDE_TILES, WIDE_FROM = 32, 512


def pass1_tiles(D: int, NT: int) -> int:
    """Time tiles per program of the backward's pass 1 for ``D`` channels and ``NT`` tiles of time."""
    tiles = TILES_PER_PROGRAM or (WIDE_TILES if D >= WIDE_FROM else 1)
    return max(1, min(tiles, NT))


# bound on first use (triton is imported lazily, as fla is: hybridlm/ops/backend.py)
tl = None
_KERNELS = None


def causal_conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                          silu: bool = True) -> torch.Tensor:
    """The torch twin: x ``[B, T, D]``, weight ``[D, W]``; fp32 math, output in x's dtype."""
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.float().transpose(1, 2), (W - 1, 0)), weight.float().unsqueeze(1),
                 None if bias is None else bias.float(), groups=weight.shape[0]).transpose(1, 2)
    return (F.silu(y) if silu else y).to(x.dtype)


# ---------------------------------------------------------------------------------------------- the kernels
# Plain functions handed to triton.jit on first use (``_kernels``); ``tl`` is bound then.

def _tap_sum(p, s_t, w, o_t, o_d, m_d, T, W: tl.constexpr, ANTI: tl.constexpr):
    """``sum_i w[:, i] * p[t - W + 1 + i]`` (causal) or ``sum_i w[:, i] * p[t + W - 1 - i]`` (anti-causal, the
    transpose) for the rows ``o_t``, in fp32; rows outside ``[0, T)`` read as 0."""
    acc = tl.zeros([o_t.shape[0], o_d.shape[0]], dtype=tl.float32)
    for i in tl.static_range(W):
        o_s = o_t + ((W - 1 - i) if ANTI else (i - W + 1))
        m = ((o_s >= 0) & (o_s < T))[:, None] & m_d[None, :]
        xi = tl.load(p + o_s[:, None] * s_t + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        acc += xi * tl.load(w + o_d * W + i, mask=m_d, other=0.0).to(tl.float32)[None, :]
    return acc


def _causal_conv_fwd_kernel(x, w, b, y, T, s_xb, s_xt, s_yb, s_yt,
                D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    o_t = i_t * BT + tl.arange(0, BT)
    m_d = o_d < D
    acc = _tap_sum(x + i_b.to(tl.int64) * s_xb, s_xt, w, o_t, o_d, m_d, T, W, False)
    if HAS_BIAS:
        acc += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    p_y = y + i_b.to(tl.int64) * s_yb + o_t[:, None] * s_yt + o_d[None, :]
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=(o_t < T)[:, None] & m_d[None, :])


def _causal_conv_bwd_weight_kernel(x, w, b, dy, da, dw, db, T, NG, s_xb, s_xt, s_dyb, s_dyt,
                       D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                       TILES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Backward, pass 1, over ``TILES`` consecutive ``[BT, BD]`` tiles of time: per tile ``da = dy * silu'(pre)``
    (stored, with SiLU, in dy's dtype and layout ``[B, T, D]``); summed over the tiles, this program's fp32
    partials ``dw[:, i] = sum_s da[s] x[s - W + 1 + i]``, ``db = sum_s da[s]`` (``dw [B * NG, D, W]``,
    ``db [B * NG, D]``, NG = the tile groups per sequence). The products accumulate element-wise in a
    ``[BT, WP, BD]`` tile (all taps' shifted x rows in one load, from cache: the pre-activation just read them)
    and are summed over time once per program, not once per tap and tile (a sum over a tile's rows crosses
    warps): at Mamba2's width the conv went from 3.29 to 2.70 ms forward + backward (BENCHMARKS.md,
    "Session 19"); the pass is still ~3x its memory time."""
    i_d, i_g, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_x = x + i_b.to(tl.int64) * s_xb
    o_w = tl.arange(0, WP)
    acc_w = tl.zeros([BT, WP, BD], dtype=tl.float32)  # [:, i, :]: tap i's products
    acc_b = tl.zeros([BT, BD], dtype=tl.float32)
    for j in range(TILES):
        o_t = (i_g * TILES + j) * BT + tl.arange(0, BT)
        m = (o_t < T)[:, None] & m_d[None, :]
        b_da = tl.load(dy + i_b.to(tl.int64) * s_dyb + o_t[:, None] * s_dyt + o_d[None, :], mask=m,
                       other=0.0).to(tl.float32)
        if SILU:
            pre = _tap_sum(p_x, s_xt, w, o_t, o_d, m_d, T, W, False)
            if HAS_BIAS:
                pre += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
            sig = tl.sigmoid(pre)
            b_da = b_da * sig * (1 + pre * (1 - sig))
            p_da = da + i_b.to(tl.int64) * T * D + o_t[:, None] * D + o_d[None, :]
            tl.store(p_da, b_da.to(da.dtype.element_ty), mask=m)
        o_x = o_t[:, None] + (o_w[None, :] - W + 1)  # [BT, WP]: the row tap i multiplies
        m_x = (((o_x >= 0) & (o_x < T) & (o_w < W)[None, :]))[:, :, None] & m_d[None, None, :]
        x3 = tl.load(p_x + o_x[:, :, None] * s_xt + o_d[None, None, :], mask=m_x, other=0.0).to(tl.float32)
        acc_w += x3 * b_da[:, None, :]
        if HAS_BIAS:
            acc_b += b_da
    i_part = (i_b * NG + i_g).to(tl.int64)
    tl.store(dw + i_part * D * W + o_d[None, :] * W + o_w[:, None], tl.sum(acc_w, 0),
             mask=(o_w < W)[:, None] & m_d[None, :])
    if HAS_BIAS:
        tl.store(db + i_part * D + o_d, tl.sum(acc_b, 0), mask=m_d)


def _causal_conv_bwd_input_kernel(da, w, dx, T, s_dab, s_dat, s_dxb, s_dxt,
                      D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Backward, pass 2: ``dx[t] = sum_i w[:, i] da[t + W - 1 - i]``, the transposed conv."""
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    o_t = i_t * BT + tl.arange(0, BT)
    m_d = o_d < D
    acc = _tap_sum(da + i_b.to(tl.int64) * s_dab, s_dat, w, o_t, o_d, m_d, T, W, True)
    p_dx = dx + i_b.to(tl.int64) * s_dxb + o_t[:, None] * s_dxt + o_d[None, :]
    tl.store(p_dx, acc.to(dx.dtype.element_ty), mask=(o_t < T)[:, None] & m_d[None, :])


def _kernels():
    """``(forward, backward pass 1, backward pass 2)``, jitted (and autotuned over the channel block and warps, on
    a GPU) on first use."""
    global _KERNELS, tl, _tap_sum
    if _KERNELS is None:
        import triton
        import triton.language as tl  # noqa: F811 -- binds the module global the kernels' source names
        _tap_sum = triton.jit(_tap_sum)
        kernels = [triton.jit(k) for k in (_causal_conv_fwd_kernel, _causal_conv_bwd_weight_kernel,
                                           _causal_conv_bwd_input_kernel)]
        if not interpreting():  # the interpreter runs one configuration
            configs = [triton.Config({"BD": bd}, num_warps=nw) for bd in (32, 64, 128, 256) for nw in (4, 8)]
            # pass 1 holds [BT, WP, BD] fp32 accumulators: wide channel blocks would spill
            pass1_configs = [triton.Config({"BD": bd}, num_warps=nw) for bd in (16, 32, 64) for nw in (4, 8)]
            kernels = [autotuned(kernels[0], configs, ["D", "W"]),
                       autotuned(kernels[1], pass1_configs, ["D", "W", "TILES"]),
                       autotuned(kernels[2], configs, ["D", "W"])]
        _KERNELS = tuple(kernels)
    return _KERNELS


def _launch_args(D: int) -> dict:
    """The channel block where the autotuner does not choose it (the interpreter)."""
    return {"BD": 16} if interpreting() else {}


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, silu):
        Bsz, T, D = x.shape
        W = weight.shape[-1]
        fwd = _kernels()[0]
        y = torch.empty(Bsz, T, D, dtype=x.dtype, device=x.device)
        grid = lambda meta: (-(-D // meta["BD"]), -(-T // BT), Bsz)  # noqa: E731
        fwd[grid](x, weight, bias, y, T, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                  D=D, W=W, BT=BT, HAS_BIAS=bias is not None, SILU=silu, **_launch_args(D))
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        Bsz, T, D = x.shape
        W = weight.shape[-1]
        NT = -(-T // BT)
        tiles = pass1_tiles(D, NT)
        NG = -(-NT // tiles)
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        _, bwd_weight, bwd_input = _kernels()
        # without SiLU, da is dy itself; with it, pass 1 writes da (dy's dtype: what fla's backward reads too)
        da = torch.empty(Bsz, T, D, dtype=dy.dtype, device=x.device) if ctx.silu else dy
        dw = torch.empty(Bsz * NG, D, W, dtype=torch.float32, device=x.device)
        db = torch.empty(Bsz * NG, D, dtype=torch.float32, device=x.device) if bias is not None else None
        bwd_weight[lambda meta: (-(-D // meta["BD"]), NG, Bsz)](
            x, weight, bias, dy, da, dw, db, T, NG, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), D=D, W=W,
            WP=next_power_of_2(W), BT=BT, TILES=tiles, HAS_BIAS=bias is not None, SILU=ctx.silu, **_launch_args(D))
        grid = lambda meta: (-(-D // meta["BD"]), NT, Bsz)  # noqa: E731
        dx = torch.empty(Bsz, T, D, dtype=x.dtype, device=x.device)
        bwd_input[grid](da, weight, dx, T, da.stride(0), da.stride(1), dx.stride(0), dx.stride(1),
                        D=D, W=W, BT=BT, **_launch_args(D))
        return (dx, dw.sum(0).to(weight.dtype), None if db is None else db.sum(0).to(bias.dtype), None)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                silu: bool = True) -> torch.Tensor:
    """``silu(conv(x))`` (or the bare conv): x ``[B, T, D]`` (a view whose last dim is contiguous is fine, e.g. a
    slice of a projection's output), weight ``[D, W]``, bias ``[D]`` or None. Output contiguous, in x's dtype."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv: x must be [B, T, D] and weight [D, W], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"causal_conv: bias must be [{x.shape[-1]}], got {tuple(bias.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _CausalConv.apply(x, weight, bias, silu)
