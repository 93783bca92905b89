"""MLA's absorbed attention for a few query rows over a long latent cache, split along the keys (flash-decoding).

A decode step of :class:`hybridlm.model.layers.mla.MultiHeadLatentAttention` attends ``H * T`` query rows
(heads folded into the query length, T = 1 when decoding) to one shared key "head", the cached ``[latent |
k_rope]`` rows, and takes the latent part as the value. Through SDPA that is one query block against all S keys:
one thread block walks the whole cache, so at batch 1 the step's time grows with S at far below the memory's
speed (from a 1k to an 8k context the 8 MLA layers read 17 MB more, and the step grows by hundreds of times
what reading those bytes takes: BENCHMARKS.md, "The MLA decode kernel").

:func:`latent_attention_decode` splits the keys into ``n_splits`` ranges, one program per (row of the batch,
range): each computes the scores of its keys for all query rows (``q_lat . k_lat + q_rope . k_rope``, fp32
accumulation), an online softmax and ``sum p v`` over its range, and writes the unnormalised output with its row
maxima and sums; a second kernel combines the ranges (``exp(m_s - max_s m_s)`` weights). The split count fills
the GPU at any batch and is fixed by the shapes, so the launch is the same at every step (CUDA graphs).
:func:`latent_attention_decode_reference` is the torch twin (fp32 softmax), the test's yardstick.

Numerics as flash attention: scores and the softmax in fp32, ``p`` rounded to the cache's dtype for the ``p v``
product, fp32 accumulation, the output in the query's dtype. In fp32 the products are IEEE (no TF32). Under
Triton's interpreter (the CPU tests) the bf16 operands go into the products as fp32, the same values: the
interpreter's bf16 ``tl.dot`` returns garbage.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from hybridlm.ops.triton_launch import load_triton

tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
_KERNELS = None

BLOCK_KEYS = 64          # keys per inner iteration
MIN_SPLIT = 128          # keys per split at least: below that the combine step costs more than it saves
MAX_ROWS = 64            # query rows (H * T) one program holds; more falls back to SDPA


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_count(batch: int, keys: int, device: torch.device) -> int:
    """Ranges per row: about two programs per SM over the batch, each at least ``MIN_SPLIT`` keys."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 8
    want = max(1, _cdiv(2 * sms, batch))
    return max(1, min(want, _cdiv(keys, MIN_SPLIT)))


def _partials_kernel(q, kv, mask, o_part, ml_part,
                     s_qb, s_qm, s_kb, s_ks, s_mb, s_mt, s_ob, s_os, s_om, s_lb, s_ls,
                     M, S, split_len, scale,
                     T: tl.constexpr, R: tl.constexpr, RO: tl.constexpr, BR: tl.constexpr, BRO: tl.constexpr,
                     BM: tl.constexpr, BS: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
                     DOT_FP32: tl.constexpr):
    """Program (batch row, key range): unnormalised ``sum_s p v`` over the range, its row maxima and sums."""
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    o_r = tl.arange(0, BR)
    o_ro = tl.arange(0, BRO)
    q_row = q + i_b * s_qb + o_m[:, None] * s_qm
    q_lat = tl.load(q_row + o_r[None, :], mask=m_m[:, None] & (o_r[None, :] < R), other=0)
    q_rope = tl.load(q_row + R + o_ro[None, :], mask=m_m[:, None] & (o_ro[None, :] < RO), other=0)
    KD: tl.constexpr = kv.dtype.element_ty
    if DOT_FP32:  # Triton's interpreter multiplies bf16 wrongly: the same values in fp32 (exact products)
        q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
    t_of_m = o_m % T                                   # query row m = head * T + t
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BR], tl.float32)
    start = i_s * split_len
    end = tl.minimum(start + split_len, S)
    kv_row = kv + i_b * s_kb
    for s0 in range(start, end, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < end
        k_lat = tl.load(kv_row + o_s[:, None] * s_ks + o_r[None, :], mask=m_s[:, None] & (o_r[None, :] < R), other=0)
        k_rope = tl.load(kv_row + o_s[:, None] * s_ks + R + o_ro[None, :], mask=m_s[:, None] & (o_ro[None, :] < RO),
                         other=0)
        if DOT_FP32:
            k_lat, k_rope = k_lat.to(tl.float32), k_rope.to(tl.float32)
        sc = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
        sc += tl.dot(q_rope, tl.trans(k_rope), input_precision=PREC)
        sc = sc * scale
        vis = m_m[:, None] & m_s[None, :]
        if HAS_MASK:
            allowed = tl.load(mask + i_b * s_mb + t_of_m[:, None] * s_mt + o_s[None, :], mask=vis, other=0)
            vis = vis & (allowed != 0)
        sc = tl.where(vis, sc, -1e30)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        p = tl.where(vis, tl.exp(sc - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(KD).to(k_lat.dtype), k_lat, input_precision=PREC)
        m_i = m_new
    tl.store(o_part + i_b * s_ob + i_s * s_os + o_m[:, None] * s_om + o_r[None, :], acc,
             mask=m_m[:, None] & (o_r[None, :] < R))
    ml = ml_part + i_b * s_lb + i_s * s_ls
    tl.store(ml + o_m, m_i, mask=m_m)
    tl.store(ml + BM + o_m, l_i, mask=m_m)


def _combine_kernel(o_part, ml_part, out, s_ob, s_os, s_om, s_lb, s_ls, s_yb, s_ym, n_splits,
                    R: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, BNS: tl.constexpr):
    """Program (batch row, query row): the ranges' outputs weighted by ``exp(m_s - max m)`` over their sums."""
    i_b = tl.program_id(0).to(tl.int64)
    i_m = tl.program_id(1)
    o_n = tl.arange(0, BNS)
    m_n = o_n < n_splits
    o_r = tl.arange(0, BR)
    ml = ml_part + i_b * s_lb + o_n * s_ls
    m_s = tl.load(ml + i_m, mask=m_n, other=-1e30)
    l_s = tl.load(ml + BM + i_m, mask=m_n, other=0.0)
    w = tl.where(m_n, tl.exp(m_s - tl.max(m_s, 0)), 0.0)
    o_s = tl.load(o_part + i_b * s_ob + o_n[:, None] * s_os + i_m * s_om + o_r[None, :],
                  mask=m_n[:, None] & (o_r[None, :] < R), other=0.0)
    o = tl.sum(o_s * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out + i_b * s_yb + i_m * s_ym + o_r, o.to(out.dtype.element_ty), mask=o_r < R)


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        triton = load_triton(globals())
        _KERNELS = (triton.jit(_partials_kernel), triton.jit(_combine_kernel))
    return _KERNELS


def _check(q, kv, mask, latent_dim: int, t: int):
    B, M, D = q.shape
    if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != D:
        raise ValueError(f"latent_attention_decode: kv {tuple(kv.shape)} does not fit q {tuple(q.shape)} ([B, S, {D}])")
    if q.dtype != kv.dtype:
        raise ValueError(f"latent_attention_decode: q is {q.dtype}, kv {kv.dtype}: expected one dtype")
    if not 0 < latent_dim < D or M % t:
        raise ValueError(f"latent_attention_decode: latent_dim {latent_dim} / query rows {M} / T {t} do not fit")
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 3 or mask.shape[0] not in (1, B) or mask.shape[1:] != (t, kv.shape[1]):
            raise ValueError(f"latent_attention_decode: mask {tuple(mask.shape)} {mask.dtype}: expected bool [B|1, "
                             f"{t}, {kv.shape[1]}]")


def latent_attention_decode(q: torch.Tensor, kv: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                            latent_dim: int, t: int = 1, n_splits: Optional[int] = None) -> torch.Tensor:
    """``softmax(q kv^T * scale, masked) kv[..., :latent_dim]`` for ``q [B, M, D]`` (M = heads * t query rows, row
    ``h * t + i`` is query ``i`` of head ``h``) against ``kv [B, S, D]`` (the cache: ``[latent | k_rope]``, last dim
    contiguous); ``mask`` bool ``[B|1, t, S]`` (True: visible; None: every key), at least one visible key per row.
    Returns ``[B, M, latent_dim]`` in q's dtype. No autograd."""
    _check(q, kv, mask, latent_dim, t)
    B, M, D = q.shape
    S = kv.shape[1]
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("latent_attention_decode: q's and kv's last dims must be contiguous")
    n_splits = n_splits or split_count(B, S, q.device)
    split_len = _cdiv(_cdiv(S, n_splits), BLOCK_KEYS) * BLOCK_KEYS   # a multiple of the key block
    n_splits = _cdiv(S, split_len)
    R, RO = latent_dim, D - latent_dim
    BR, BRO, BM = max(16, _next_pow2(R)), max(16, _next_pow2(RO)), max(16, _next_pow2(M))
    o_part = torch.empty(B, n_splits, BM, R, dtype=torch.float32, device=q.device)
    ml_part = torch.empty(B, n_splits, 2 * BM, dtype=torch.float32, device=q.device)
    out = torch.empty(B, M, R, dtype=q.dtype, device=q.device)
    partials, combine = _kernels()
    s_mb = s_mt = 0
    if mask is not None:  # bytes, read as 0 / 1 (a bool tensor's storage)
        mask = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)
        s_mb, s_mt = (mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(1)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    prec = "ieee" if q.dtype == torch.float32 or interpreted else "tf32"
    partials[(B, n_splits)](
        q, kv, mask, o_part, ml_part, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), s_mb, s_mt,
        *o_part.stride()[:3], *ml_part.stride()[:2], M, S, split_len, float(scale),
        T=t, R=R, RO=RO, BR=BR, BRO=BRO, BM=BM, BS=BLOCK_KEYS, HAS_MASK=mask is not None, PREC=prec,
        DOT_FP32=interpreted, num_warps=4)
    combine[(B, M)](o_part, ml_part, out, *o_part.stride()[:3], *ml_part.stride()[:2], out.stride(0), out.stride(1),
                    n_splits, R=R, BR=BR, BM=BM, BNS=max(2, _next_pow2(n_splits)), num_warps=1)
    return out


def latent_attention_decode_reference(q, kv, mask, scale: float, latent_dim: int, t: int = 1) -> torch.Tensor:
    """The torch twin: fp32 scores and softmax, the output in q's dtype."""
    _check(q, kv, mask, latent_dim, t)
    B, M, _ = q.shape
    s = torch.einsum("bmd,bsd->bms", q.float(), kv.float()) * scale
    if mask is not None:
        rows = mask.expand(B, -1, -1).repeat(1, M // t, 1)   # row h * t + i takes mask row i
        s = s.masked_fill(~rows, float("-inf"))
    return torch.einsum("bms,bsr->bmr", s.softmax(-1), kv[..., :latent_dim].float()).to(q.dtype)
