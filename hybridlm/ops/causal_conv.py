"""Depthwise causal short convolution (+ SiLU) without a state, in Triton: forward and a two-pass backward.

The training path of every recurrent mixer runs one such conv per layer (Mamba2 over ``[x | B | C]``, 3,072
channels at 300M; GDN / KDA over q, k and v). fla's ``causal_conv1d`` (fla/modules/causal_conv1d/ops.py) first
recomputes the forward into a new tensor, then one kernel reads that tensor and ``dy`` once per tap and writes the
weight gradient as one fp32 row per tile and tap. At Mamba2-300M's shape (12 layers of [64, 2048, 3072]) that
backward takes several times what reading x and dy and writing dx once would take (BENCHMARKS.md, "Non-GEMM
kernels alone", fla's conv against the memory floor).

:func:`causal_conv` computes the same function (``silu(b + sum_i w[:, i] x[t - W + 1 + i])``, fp32 sums in fla's
tap order). Backward, pass 1 per ``[BT, BD]`` tile (a program takes :func:`pass1_tiles` of them in time): the
pre-activation from ``x`` (its shifted tiles come from cache), ``da = dy * silu'(pre)`` stored in dy's dtype, and
fp32 partials of ``dw`` and ``db`` from the same x tiles, accumulated element-wise and summed over time once per
program (one row per program, summed after); pass 2: ``dx``, the transposed conv of ``da``. Two passes,
because one pass would recompute the pre-activation of the ``W - 1`` following rows for every tap instead of
storing ``da``, slower than fla's at the Mamba2 shape (BENCHMARKS.md, "Training step breakdown").

:func:`causal_conv_reference` is the torch twin the tests hold the kernels to (through Triton's interpreter on
CPU, compiled on GPU). No cached state: generation's conv continues from a state through
``hybridlm.ops.elementwise.short_conv_with_state``, which prepends the state and calls this.

:func:`causal_conv_split` writes the conv's output over adjacent column blocks of one input as one contiguous
tensor per block (GDN / KDA's q, k and v, which the fused projection leaves side by side and which have a conv each;
Mamba2's x, B and C): what fla's recurrence kernels take without a copy. The kernels take up to three output
segments; a channel block never straddles two (the autotuner keeps only channel blocks that divide every
segment's width). Its backward can write dx into the input's slot of a split projection's gradient
(hybridlm/ops/gradient_slots.py). With a :class:`HeadNorm` it also L2-normalises the first blocks' heads (GDN /
KDA's q and k, one head a channel block) and stores each head once per value head that shares it; pass 1 of the
backward sums the copies' gradients and goes back through the norm from the row it recomputes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hybridlm.ops.gradient_slots import GradientSlot, gradient_into
from hybridlm.ops.triton_launch import autotuned, interpreting, load_triton, next_power_of_2

BT = 64  # rows of time per tile (fixed: the partial-gradient buffers are sized by it)
# time tiles per program of the backward's pass 1, whose fp32 weight-gradient partials (one row per program) are
# summed after: more tiles, fewer partials to write and fewer sums over time, but fewer programs. 0 picks by width:
# measured on an H200 at [64, 2048, D] (BENCHMARKS.md, "Training step breakdown"), 32 tiles were fastest at
# D = 512 and 3,072,
# one tile at D = 256 (its grid too small otherwise). benchmarks/kernel_bench.py --conv-tiles sweeps it.
TILES_PER_PROGRAM = 0
WIDE_TILES, WIDE_FROM = 32, 512


def pass1_tiles(D: int, NT: int) -> int:
    """Time tiles per program of the backward's pass 1 for ``D`` channels and ``NT`` tiles of time."""
    tiles = TILES_PER_PROGRAM or (WIDE_TILES if D >= WIDE_FROM else 1)
    return max(1, min(tiles, NT))


tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
_JITTED = None
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


def _segment_rows(i_b, i_d, o_t, p0, s0b, s0t, p1, s1b, s1t, p2, s2b, s2t,
                  D0: tl.constexpr, D1: tl.constexpr, BD: tl.constexpr, NSEG: tl.constexpr,
                  NW: tl.constexpr, REPEAT: tl.constexpr, j: tl.constexpr):
    """Pointers ``[BT, BD]`` to rows ``o_t`` of channel block ``i_d`` of a tensor whose channels are split over
    ``NSEG`` tensors: ``[0, D0)`` in p0, ``[D0, D0 + D1)`` in p1, the rest in p2. The block lies in one of them
    (the caller's channel blocks divide the widths), so its base is a scalar choice and its rows stay contiguous
    runs. A block of the first ``NW`` channels (one head: the block is the head) is stored ``REPEAT`` times side
    by side: ``j`` picks the copy (heads repeated in place, as ``repeat_interleave`` over heads)."""
    base = p0 + i_b.to(tl.int64) * s0b
    s_t = s0t
    first = 0
    if NSEG > 1:
        in1 = i_d * BD >= D0
        base = tl.where(in1, p1 + i_b.to(tl.int64) * s1b, base)
        s_t = tl.where(in1, s1t, s_t)
        first = tl.where(in1, D0, first)
    if NSEG > 2:
        in2 = i_d * BD >= D0 + D1
        base = tl.where(in2, p2 + i_b.to(tl.int64) * s2b, base)
        s_t = tl.where(in2, s2t, s_t)
        first = tl.where(in2, D0 + D1, first)
    start = i_d * BD - first  # the block's first channel in its segment
    if REPEAT > 1:
        start = tl.where(i_d * BD < NW, start * REPEAT + j * BD, start)
    return base + o_t[:, None] * s_t + (start + tl.arange(0, BD))[None, :]


def _tap_rows(p, s_t, o_t, o_w, o_d, m_d, T, W: tl.constexpr):
    """``[rows, WP, BD]`` fp32: for each row ``t`` of ``o_t``, the rows ``t - W + 1 + i`` that tap ``i``
    multiplies (0 outside ``[0, T)`` and for ``i >= W``)."""
    o_x = o_t[:, None] + (o_w[None, :] - W + 1)
    m_x = (((o_x >= 0) & (o_x < T) & (o_w < W)[None, :]))[:, :, None] & m_d[None, None, :]
    return tl.load(p + o_x[:, :, None] * s_t + o_d[None, None, :], mask=m_x, other=0.0).to(tl.float32)


def _head_rstd(u, eps):
    """``1 / sqrt(sum u^2 + eps)`` over each row of a ``[rows, BD]`` block that is one head (fla's l2norm)."""
    return 1 / tl.sqrt(tl.sum(u * u, 1) + eps)


def _causal_conv_fwd_kernel(x, w, b, y0, y1, y2, T, s_xb, s_xt, s_y0b, s_y0t, s_y1b, s_y1t, s_y2b, s_y2t, eps,
                D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, NSEG: tl.constexpr,
                NW: tl.constexpr, REPEAT: tl.constexpr, HEAD: tl.constexpr):
    """``silu(conv(x))`` for a ``[BT, BD]`` tile; in the first ``NW`` channels (``BD`` = the head) each row
    L2-normalised over the head and stored ``REPEAT`` times (:class:`HeadNorm`)."""
    tl.static_assert(NW == 0 or BD == HEAD, "a normalised head must be one channel block")
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    o_t = i_t * BT + tl.arange(0, BT)
    m_d = o_d < D
    acc = _tap_sum(x + i_b.to(tl.int64) * s_xb, s_xt, w, o_t, o_d, m_d, T, W, False)
    if HAS_BIAS:
        acc += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    in_norm = (o_d < NW)[None, :]  # the block's channels are all normalised or none
    if NW > 0:
        acc = tl.where(in_norm, acc * _head_rstd(acc, eps)[:, None], acc)
    m = (o_t < T)[:, None] & m_d[None, :]
    for j in tl.static_range(REPEAT):
        p_y = _segment_rows(i_b, i_d, o_t, y0, s_y0b, s_y0t, y1, s_y1b, s_y1t, y2, s_y2b, s_y2t,
                            D0, D1, BD, NSEG, NW, REPEAT, j)
        if j == 0:
            tl.store(p_y, acc.to(y0.dtype.element_ty), mask=m)
        else:  # the repeats: heads of the normalised channels only
            tl.store(p_y, acc.to(y0.dtype.element_ty), mask=m & in_norm)


def _causal_conv_bwd_weight_kernel(x, w, b, dy0, dy1, dy2, da, dw, db, T, NG, s_xb, s_xt,
                       s_dy0b, s_dy0t, s_dy1b, s_dy1t, s_dy2b, s_dy2t, eps,
                       D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                       TILES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                       D0: tl.constexpr, D1: tl.constexpr, NSEG: tl.constexpr, BR: tl.constexpr,
                       NW: tl.constexpr, REPEAT: tl.constexpr, HEAD: tl.constexpr, X_ONCE: tl.constexpr):
    """Backward, pass 1, over ``TILES`` consecutive ``[BT, BD]`` tiles of time, ``BR`` rows at a time (``BR``
    divides ``BT``): per block of rows ``da = dy * silu'(pre)``
    (``dy`` split over ``NSEG`` tensors as the forward's output; ``da`` stored, with SiLU, in dy's dtype and one
    layout ``[B, T, D]``); summed over the tiles, this program's fp32
    partials ``dw[:, i] = sum_s da[s] x[s - W + 1 + i]``, ``db = sum_s da[s]`` (``dw [B * NG, D, W]``,
    ``db [B * NG, D]``, NG = the tile groups per sequence). The products accumulate element-wise in a
    ``[BR, WP, BD]`` tile (all taps' shifted x rows in one load, from cache: the pre-activation just read them)
    and are summed over time once per program, not once per tap and tile (a sum over a tile's rows crosses
    warps), which makes the conv faster at Mamba2's width; the pass still takes ~3x its memory time
    (BENCHMARKS.md, "Non-GEMM kernels alone"). With ``BR = BT`` that tile takes 186 registers a
    thread at 64 channels and 8 warps (one block an SM: few loads in flight for a memory-bound pass); fewer rows
    at a time take fewer (``python -m benchmarks.harness.kernel_compile``), and the autotuner picks.
    In the first ``NW`` channels (a head a block) ``dy`` is the sum over the head's ``REPEAT`` copies, taken back
    through the L2 norm (the normalised row recomputed from x in fp32) before the SiLU.
    ``X_ONCE``: the pre-activation from the same ``[BR, WP, BD]`` x tile the products use (one load of the taps'
    rows, a sum over taps in registers, the taps' weights loaded once) instead of a load per tap first; offered
    to the autotuner by :func:`offer_pass1_x_once`."""
    tl.static_assert(NW == 0 or BD == HEAD, "a normalised head must be one channel block")
    i_d, i_g, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_x = x + i_b.to(tl.int64) * s_xb
    o_w = tl.arange(0, WP)
    in_norm = (o_d < NW)[None, :]  # the block's channels are all normalised or none
    acc_w = tl.zeros([BR, WP, BD], dtype=tl.float32)  # [:, i, :]: tap i's products
    acc_b = tl.zeros([BR, BD], dtype=tl.float32)
    if X_ONCE:  # the taps' weights as a [WP, BD] tile, for the pre-activation from the x tile
        w3 = tl.load(w + o_d[None, :] * W + o_w[:, None], mask=(o_w < W)[:, None] & m_d[None, :],
                     other=0.0).to(tl.float32)
    for j in range(TILES * (BT // BR)):
        o_t = i_g * TILES * BT + j * BR + tl.arange(0, BR)
        m = (o_t < T)[:, None] & m_d[None, :]
        p_dy = _segment_rows(i_b, i_d, o_t, dy0, s_dy0b, s_dy0t, dy1, s_dy1b, s_dy1t, dy2, s_dy2b, s_dy2t,
                             D0, D1, BD, NSEG, NW, REPEAT, 0)
        b_da = tl.load(p_dy, mask=m, other=0.0).to(tl.float32)
        for r in tl.static_range(1, REPEAT):  # a repeated head's gradient: the sum over its copies
            p_dy = _segment_rows(i_b, i_d, o_t, dy0, s_dy0b, s_dy0t, dy1, s_dy1b, s_dy1t, dy2, s_dy2b, s_dy2t,
                                 D0, D1, BD, NSEG, NW, REPEAT, r)
            b_da += tl.load(p_dy, mask=m & in_norm, other=0.0).to(tl.float32)
        if X_ONCE:
            x3 = _tap_rows(p_x, s_xt, o_t, o_w, o_d, m_d, T, W)
        if SILU or NW > 0:
            if X_ONCE:
                pre = tl.sum(x3 * w3[None, :, :], 1)
            else:
                pre = _tap_sum(p_x, s_xt, w, o_t, o_d, m_d, T, W, False)
            if HAS_BIAS:
                pre += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
            if SILU:
                sig = tl.sigmoid(pre)
            if NW > 0:  # through y = u * rstd: du = rstd * (dy - y * sum(dy * y)), u the conv's output
                u = pre
                if SILU:
                    u = pre * sig
                rstd = _head_rstd(u, eps)[:, None]
                y = u * rstd
                b_da = tl.where(in_norm, (b_da - y * tl.sum(b_da * y, 1)[:, None]) * rstd, b_da)
            if SILU:
                b_da = b_da * sig * (1 + pre * (1 - sig))
        if SILU or NSEG > 1 or NW > 0:  # pass 2 reads one da: dy itself only when it is one tensor, as it came
            p_da = da + i_b.to(tl.int64) * T * D + o_t[:, None] * D + o_d[None, :]
            tl.store(p_da, b_da.to(da.dtype.element_ty), mask=m)
        if not X_ONCE:  # loaded only now: the tile is not live while the pre-activation is computed
            x3 = _tap_rows(p_x, s_xt, o_t, o_w, o_d, m_d, T, W)
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


def _jitted():
    """``(forward, backward pass 1, backward pass 2)`` as ``triton.jit`` functions, jitted once (with the functions
    they call); the autotuners over them are rebuilt when the configurations offered change."""
    global _JITTED, _tap_sum, _tap_rows, _segment_rows, _head_rstd
    if _JITTED is None:
        triton = load_triton(globals())
        _tap_sum, _tap_rows, _segment_rows, _head_rstd = (triton.jit(f) for f in (_tap_sum, _tap_rows, _segment_rows,
                                                                                   _head_rstd))
        _JITTED = tuple(triton.jit(k) for k in (_causal_conv_fwd_kernel, _causal_conv_bwd_weight_kernel,
                                                _causal_conv_bwd_input_kernel))
    return _JITTED


def _kernels():
    """``(forward, backward pass 1, backward pass 2)``; on a GPU autotuned over the channel block and warps (pass 1
    also over its rows at a time, and ``X_ONCE`` where offered), keeping only channel blocks that fit the
    segments."""
    global _KERNELS
    if _KERNELS is None:
        kernels = list(_jitted())
        if not interpreting():  # the interpreter runs one configuration
            triton = load_triton()
            configs = [triton.Config({"BD": bd}, num_warps=nw) for bd in (32, 64, 128, 256) for nw in (4, 8)]
            # pass 1 holds [BR, WP, BD] fp32 accumulators: wide channel blocks would spill, and many rows at a time
            # leave few warps an SM (128 channels only where a head of 128 must be one block)
            pass1_configs = [triton.Config({"BD": bd, "BR": br, "X_ONCE": once}, num_warps=nw)
                             for bd in (16, 32, 64, 128) for br in PASS1_ROWS for nw in (4, 8)
                             for once in PASS1_X_ONCE]
            tiled = ["D", "W", "D0", "D1", "NW", "REPEAT"]
            kernels = [autotuned(kernels[0], configs, tiled, prune=_prune_configs),
                       autotuned(kernels[1], pass1_configs, tiled + ["TILES"], prune=_prune_configs),
                       autotuned(kernels[2], configs, ["D", "W"])]
        _KERNELS = tuple(kernels)
    return _KERNELS


def _prune_configs(configs, named_args, **kwargs):
    """The autotuner's configurations that fit the launch: those whose channel block divides every output
    segment's width (with one segment, all: the kernels mask the last block); where heads are normalised
    (``NW > 0``), those whose block is the head.
    Pass 1's 128-channel blocks only for heads of 128, and its ``X_ONCE`` only where the x tile and the
    accumulator fit a thread's registers (at most 32 fp32 elements each; more spilled when compiled for sm_90:
    ``python -m benchmarks.harness.kernel_compile``)."""
    args = {**named_args, **kwargs}
    configs = [c for c in configs if not c.kwargs.get("X_ONCE") or x_once_fits(c.kwargs["BR"], c.kwargs["BD"],
                                                                                   c.num_warps)]
    if args.get("NW", 0) > 0:
        return [c for c in configs if c.kwargs["BD"] == args["HEAD"]]
    configs = [c for c in configs if "BR" not in c.kwargs or c.kwargs["BD"] <= 64]
    if args["NSEG"] == 1:
        return configs
    widths = (args["D0"], args["D1"], args["D"] - args["D0"] - args["D1"])[:args["NSEG"]]
    return [c for c in configs if all(w % c.kwargs["BD"] == 0 for w in widths)]


def x_once_fits(rows: int, channels: int, num_warps: int, taps: int = 4) -> bool:
    """Whether pass 1's ``X_ONCE`` keeps its ``[rows, taps, channels]`` fp32 x tile and accumulator within 32
    elements a thread each (beyond, they spilled when compiled for sm_90)."""
    return rows * taps * channels <= 32 * 32 * num_warps


SEGMENT_ALIGN = 32  # the narrowest channel block of the forward's configurations: segments must be multiples of it
NORM_HEAD_DIMS = (32, 64, 128)  # heads the kernels normalise on a GPU: a channel block of both passes' configurations
INTERPRETER_BD = 16
PASS1_ROWS = (16, 32, 64)  # rows per iteration of the backward's pass 1 (each divides BT) the autotuner tries
INTERPRETER_PASS1_ROWS = 32  # the one the interpreter runs (the CPU tests set it per case)
INTERPRETER_PASS1_X_ONCE = False  # the same for pass 1's X_ONCE
# pass 1's X_ONCE choices for its autotuner: not offered by default (offered at the 300M models' conv shapes on an
# H200, the autotuner never picked it: BENCHMARKS.md, "Training step breakdown"); offer_pass1_x_once offers it
PASS1_X_ONCE = (False,)


def offer_pass1_x_once(on: bool) -> None:
    """Offer pass 1's autotuner ``X_ONCE`` (the pre-activation from the products' x tile) beside the per-tap
    path, or stop offering it; process-wide, the kernels rebuilt on next use (``benchmarks.train_speed
    --conv-x-once``, ``benchmarks/kernel_bench.py``)."""
    global PASS1_X_ONCE, _KERNELS
    choices = (False, True) if on else (False,)
    if choices != PASS1_X_ONCE:
        PASS1_X_ONCE, _KERNELS = choices, None


@dataclass(frozen=True)
class HeadNorm:
    """What :func:`causal_conv_split` does to its first ``segments`` outputs after the conv + SiLU: each head of
    ``head_dim`` channels L2-normalised (``u / sqrt(sum u^2 + eps)``, fla's ``l2norm``) and stored ``repeat``
    times side by side, as ``repeat_interleave`` over heads. GDN / KDA's q and k: normalised as fla's kernels
    would normalise them, and GDN's q / k heads repeated for its grouped value heads (fla's kernels index a q / k
    head per value head either way; given them one per value head, its backward sums no gradients over groups)."""
    segments: int
    head_dim: int
    repeat: int = 1
    eps: float = 1e-6

    def width(self, widths) -> int:
        """The input channels it normalises."""
        return sum(widths[:self.segments])

    def output_widths(self, widths) -> tuple:
        return tuple(w * self.repeat if j < self.segments else w for j, w in enumerate(widths))


def _launch_args(head_norm: Optional[HeadNorm] = None) -> dict:
    """The channel block where the autotuner does not choose it (the interpreter): the head where heads are
    normalised."""
    if not interpreting():
        return {}
    return {"BD": head_norm.head_dim if head_norm else INTERPRETER_BD}


def _segment_args(tensors) -> list:
    """The kernels' segment arguments: three tensors (the last repeated where there are fewer segments: the
    kernels do not read those), then each one's batch and row strides."""
    tensors = list(tensors) + [tensors[-1]] * (3 - len(tensors))
    return tensors + [s for t in tensors for s in (t.stride(0), t.stride(1))]


class _CausalConv(torch.autograd.Function):
    """The conv over ``x``'s channels, its output split into ``widths`` (one or up to three contiguous tensors),
    optionally with a :class:`HeadNorm` on the first of them."""

    @staticmethod
    def forward(ctx, x, weight, bias, silu, widths, grad_slot, head_norm):
        Bsz, T, D = x.shape
        W = weight.shape[-1]
        fwd = _kernels()[0]
        out_widths = head_norm.output_widths(widths) if head_norm else widths
        ys = [torch.empty(Bsz, T, w, dtype=x.dtype, device=x.device) for w in out_widths]
        grid = lambda meta: (-(-D // meta["BD"]), -(-T // BT), Bsz)  # noqa: E731
        seg = _segment_args(ys)
        fwd[grid](x, weight, bias, *seg[:3], T, x.stride(0), x.stride(1), *seg[3:], _eps(head_norm),
                  **_segment_constants(D, widths, head_norm), W=W, BT=BT, HAS_BIAS=bias is not None, SILU=silu,
                  **_launch_args(head_norm))
        ctx.save_for_backward(x, weight, bias)
        ctx.silu, ctx.widths, ctx.grad_slot, ctx.head_norm = silu, widths, grad_slot, head_norm
        ctx.out_widths = out_widths
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, weight, bias = ctx.saved_tensors
        Bsz, T, D = x.shape
        W = weight.shape[-1]
        NT = -(-T // BT)
        tiles = pass1_tiles(D, NT)
        NG = -(-NT // tiles)
        head_norm = ctx.head_norm
        # an output the loss did not use has no gradient: zeros, so that the kernels read one tensor per segment
        dys = [torch.zeros(Bsz, T, w, dtype=x.dtype, device=x.device) if dy is None
               else dy if dy.stride(-1) == 1 else dy.contiguous() for dy, w in zip(dys, ctx.out_widths)]
        _, bwd_weight, bwd_input = _kernels()
        # da is dy itself only for one segment as it came (no SiLU, no norm); else pass 1 writes it in dy's dtype
        # (what fla's reads)
        da = dys[0] if not ctx.silu and len(dys) == 1 and head_norm is None else \
            torch.empty(Bsz, T, D, dtype=dys[0].dtype, device=x.device)
        dw = torch.empty(Bsz * NG, D, W, dtype=torch.float32, device=x.device)
        db = torch.empty(Bsz * NG, D, dtype=torch.float32, device=x.device) if bias is not None else None
        seg = _segment_args(dys)
        bwd_weight[lambda meta: (-(-D // meta["BD"]), NG, Bsz)](
            x, weight, bias, *seg[:3], da, dw, db, T, NG, x.stride(0), x.stride(1), *seg[3:], _eps(head_norm),
            **_segment_constants(D, ctx.widths, head_norm), W=W,
            WP=next_power_of_2(W), BT=BT, TILES=tiles, HAS_BIAS=bias is not None, SILU=ctx.silu,
            **_launch_args(head_norm),
            **({"BR": INTERPRETER_PASS1_ROWS, "X_ONCE": INTERPRETER_PASS1_X_ONCE} if interpreting() else {}))
        grid = lambda meta: (-(-D // meta["BD"]), NT, Bsz)  # noqa: E731
        # in place in the split projection's gradient where x is a block of it (gradient_slots.py)
        dx = gradient_into(ctx.grad_slot, x.shape, x.dtype, x.device)
        bwd_input[grid](da, weight, dx, T, da.stride(0), da.stride(1), dx.stride(0), dx.stride(1),
                        D=D, W=W, BT=BT, **_launch_args())
        return (dx, dw.sum(0).to(weight.dtype), None if db is None else db.sum(0).to(bias.dtype),
                None, None, None, None)


def _eps(head_norm: Optional[HeadNorm]) -> float:
    return head_norm.eps if head_norm else 0.0


def _segment_constants(D: int, widths, head_norm: Optional[HeadNorm] = None) -> dict:
    """The kernels' constexprs for the output split ``widths``: the total, the first two widths and their count;
    the channels a :class:`HeadNorm` normalises (0: none), its repeat and head."""
    return {"D": D, "D0": widths[0], "D1": widths[1] if len(widths) > 1 else 0, "NSEG": len(widths),
            "NW": head_norm.width(widths) if head_norm else 0, "REPEAT": head_norm.repeat if head_norm else 1,
            "HEAD": head_norm.head_dim if head_norm else 0}


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], name: str) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: x must be [B, T, D] and weight [D, W], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"{name}: bias must be [{x.shape[-1]}], got {tuple(bias.shape)}")


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                silu: bool = True) -> torch.Tensor:
    """``silu(conv(x))`` (or the bare conv): x ``[B, T, D]`` (a view whose last dim is contiguous is fine, e.g. a
    slice of a projection's output), weight ``[D, W]``, bias ``[D]`` or None. Output contiguous, in x's dtype."""
    _check(x, weight, bias, "causal_conv")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _CausalConv.apply(x, weight, bias, silu, (x.shape[-1],), None, None)[0]


def can_split(widths, head_norm: Optional[HeadNorm] = None) -> bool:
    """Whether :func:`causal_conv_split` runs ``widths`` as one conv: at most three segments, each a multiple of
    the narrowest channel block the kernels may take (else it runs one conv per segment); with a
    :class:`HeadNorm`, each a multiple of its head, a head the kernels take as a block."""
    align = INTERPRETER_BD if interpreting() else SEGMENT_ALIGN
    if head_norm is not None:
        hd = head_norm.head_dim
        heads = NORM_HEAD_DIMS if not interpreting() else (hd,) if hd & (hd - 1) == 0 else ()  # a power of 2
        if hd not in heads or not 1 <= head_norm.segments <= len(widths):
            return False
        align = head_norm.head_dim
    return 1 <= len(widths) <= 3 and all(w > 0 and w % align == 0 for w in widths)


def head_normalized(y: torch.Tensor, head_norm: HeadNorm) -> torch.Tensor:
    """:class:`HeadNorm` on one conv output ``[B, T, C]`` in torch (fp32 math, y's dtype): the twin's, and the
    per-block path's where the kernels cannot take the split."""
    B, T, C = y.shape
    u = y.float().view(B, T, C // head_norm.head_dim, head_norm.head_dim)
    u = u * torch.rsqrt(u.pow(2).sum(-1, keepdim=True) + head_norm.eps)
    return u.repeat_interleave(head_norm.repeat, dim=2).reshape(B, T, -1).to(y.dtype)


def causal_conv_split(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], widths: Sequence[int],
                      silu: bool = True, grad_slot: Optional[GradientSlot] = None,
                      head_norm: Optional[HeadNorm] = None) -> tuple:
    """The conv of :func:`causal_conv` over ``x``'s channels, its output as one contiguous ``[B, T, w]`` tensor per
    block of ``widths`` (adjacent column blocks: GDN / KDA's q | k | v, Mamba2's x | B | C). One kernel for all
    blocks where :func:`can_split` holds (one forward and two backward kernels where a conv per block would
    launch three each), else one conv per block. ``weight [sum(widths), W]``, ``bias`` the same rows or None.
    ``grad_slot``: where the backward writes x's gradient (hybridlm/ops/gradient_slots.py), if x is a block of a
    split projection. ``head_norm``: the first blocks' heads L2-normalised and repeated (:class:`HeadNorm`;
    their outputs are ``repeat`` times wider)."""
    widths = tuple(int(w) for w in widths)
    _check(x, weight, bias, "causal_conv_split")
    if sum(widths) != x.shape[-1]:
        raise ValueError(f"causal_conv_split: widths {widths} must add up to x's {x.shape[-1]} channels")
    if head_norm is not None and any(w % head_norm.head_dim for w in widths[:head_norm.segments]):
        raise ValueError(f"causal_conv_split: the first {head_norm.segments} widths of {widths} must be multiples "
                         f"of head_norm's head_dim {head_norm.head_dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not can_split(widths, head_norm):
        starts = [sum(widths[:j]) for j in range(len(widths))]
        ys = [causal_conv(x[..., s:s + w], weight[s:s + w], None if bias is None else bias[s:s + w], silu)
              for s, w in zip(starts, widths)]
        return tuple(head_normalized(y, head_norm) if head_norm and j < head_norm.segments else y
                     for j, y in enumerate(ys))
    return _CausalConv.apply(x, weight, bias, silu, widths, grad_slot, head_norm)


def causal_conv_split_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                widths: Sequence[int], silu: bool = True,
                                head_norm: Optional[HeadNorm] = None) -> tuple:
    """The torch twin of :func:`causal_conv_split`: :func:`causal_conv_reference` over each block, then
    :func:`head_normalized` on the first ``head_norm.segments`` of them from the fp32 conv output."""
    starts = [sum(widths[:j]) for j in range(len(widths))]
    out = []
    for j, (s, w) in enumerate(zip(starts, widths)):
        y = causal_conv_reference(x[..., s:s + w].float(), weight[s:s + w].float(),
                                  None if bias is None else bias[s:s + w].float(), silu)
        out.append((head_normalized(y, head_norm) if head_norm and j < head_norm.segments else y).to(x.dtype))
    return tuple(out)
