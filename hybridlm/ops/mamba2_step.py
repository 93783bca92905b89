"""One cached decode token of a Mamba2 mixer, everything between ``in_proj`` and ``out_proj``, in one kernel.

Unfused, a cached one-token step of :class:`hybridlm.model.layers.mamba2.Mamba2` launches 20-40 small kernels
between its two GEMMs (29 aten ops in fp32, 41 in bf16 on the torch path at the tiny test shapes; the Triton
path swaps the recurrence's ~9 for fla's kernel and its copies): the conv-state shift and the depthwise conv,
SiLU, the head repetitions, softplus(dt + dt_bias), the decay, the dt-scaled keys, the recurrent step, the state
copies into the cache, the D skip, the gated group RMSNorm and its casts. A decode step, even replayed from a
CUDA graph, is bound by their number, not by their work. :func:`mamba2_decode_step` does all of it in one Triton
kernel (a layer's step is then in_proj, this kernel, out_proj), updating the conv state ``[B, conv_dim, W]`` and
the SSD state ``[B, H, N, P]`` (fp32) *in place* (a static cache's buffers keep their addresses: CUDA graphs
replay on them). :func:`mamba2_decode_step_reference` is its torch twin: the composition of the project's
existing ops, in the layer's order (the tests check the twin against the layer and the kernel against the twin).

Inputs are the three parts of ``in_proj``'s output for the token, as views: ``z [B, d_inner]``, ``xbc [B,
conv_dim]`` (``[x (d_xb) | B (d_b) | C (n_groups * N)]``) and ``dt [B, H]``. Head ``h`` reads x head ``h //
xb_repeat`` (MambaInLlama's ``d_xb``: x and B are narrower and repeated across heads like grouped-query
attention), B group ``h // (H / (d_b / N))`` and C group ``h // (H / n_groups)``; the gated RMSNorm runs over
groups of ``d_inner / n_groups`` channels, i.e. the heads of one C group.

**Kernel.** Grid ``(B, d_b / N)``: one program per batch row and *B group* (the heads sharing one B vector:
``xb_repeat`` norm groups of ``H / n_groups`` heads, all of whose x heads and C groups are used by no other
program). So every conv channel, state entry and output channel belongs to exactly one program, and the in-place
updates need no synchronisation between programs. A program computes its B vector (conv step + bias + SiLU,
state shifted in place), then for each of its norm groups the C vector, then per head and tile of ``BP`` value
channels: the x conv (the x head's state is written by the last head repeating it, after every head has read
it), ``dt = softplus(dt + dt_bias)``, ``h = exp(-exp(A_log) dt) h + (dt B) x^T`` in fp32 (state tile ``[N, BP]``
in registers, stored back in place), ``y = C^T h + D x``, ``y * silu(z)`` and its sum of squares; a second pass
over the norm group rescales by ``rsqrt(mean + eps) * weight`` (the first pass parks ``y`` in the output, in
its final dtype, so nothing extra is allocated and nothing is rounded differently). ``tl.debug_barrier()`` sits
between every read of a location and another thread's write of it inside a program.

**Numerics** follow the composed path step by step: the conv state read in the activations' dtype, products
and sums of the conv in the conv's dtype (``promote(activations, conv weight)``), ``dt`` and the decay in fp32,
the keys ``B * dt`` rounded to B's dtype, the state math in fp32, ``y`` rounded to that dtype before the D skip
(an ``addcmul`` in that dtype), the gated norm in fp32 (``z + z_bias`` rounded to z's dtype first). Measured
against the twin in the interpreter: fp32 to ~3e-7 relative, bf16 bit for bit (tests/test_mamba2_step.py).

**Padding** (a dynamic cache's left-padded batch): ``keep [B]`` (bool, the new token's column of the
attention mask) zeroes a padded row's conv output, as ``InferenceContext.zero_padding`` does in the layer (its
input projection is already zero: the layer zeroes the hidden state first). Such a row's conv state still shifts
in that zero and its SSD state still decays, exactly as on the composed path; its output is 0.
"""
from __future__ import annotations

from typing import Optional

import torch

from hybridlm.ops.chunked_recurrence import gated_recurrence_with_state
from hybridlm.ops.elementwise import gated_rms_norm, short_conv_with_state
from hybridlm.ops.mamba2_inputs import ssd_inputs
from hybridlm.ops.triton_launch import load_triton

tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
_KERNEL = None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _dims(z, xbc, dt, conv_weight, head_dim, d_state, n_groups, d_xb):
    """Shape bookkeeping shared by the kernel and its twin (and the checks the layer's config guarantees)."""
    Bsz, d_inner = z.shape
    H = dt.shape[-1]
    if d_inner != H * head_dim:
        raise ValueError(f"mamba2_decode_step: z has {d_inner} channels, dt {H} heads of head_dim {head_dim}")
    if d_inner % d_xb or d_xb % head_dim:
        raise ValueError(f"mamba2_decode_step: d_xb {d_xb} must divide d_inner {d_inner} and be whole heads")
    repeat = d_inner // d_xb
    if n_groups % repeat or H % n_groups:
        raise ValueError(f"mamba2_decode_step: n_groups {n_groups} must be a multiple of xb_repeat {repeat} "
                         f"and divide the {H} heads")
    d_b = n_groups * d_state // repeat
    conv_dim = d_xb + d_b + n_groups * d_state
    if xbc.shape != (Bsz, conv_dim) or dt.shape != (Bsz, H) or conv_weight.shape[0] != conv_dim:
        raise ValueError(f"mamba2_decode_step: xbc {tuple(xbc.shape)}, dt {tuple(dt.shape)}, conv weight "
                         f"{tuple(conv_weight.shape)} do not fit batch {Bsz}, conv_dim {conv_dim}, {H} heads")
    return Bsz, d_inner, H, repeat, d_b, conv_dim


def mamba2_decode_step_reference(z, xbc, dt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                                 norm_weight, z_bias=None, *, head_dim: int, d_state: int, n_groups: int,
                                 d_xb: int, norm_eps: float, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch twin of :func:`mamba2_decode_step`: ``Mamba2.forward``'s cached one-token step (torch path)
    from ``in_proj``'s output to ``out_proj``'s input, through the same ops in the same order. Updates
    ``conv_state`` and ``ssm_state`` in place (``copy_``, as a static cache does); returns ``y [B, d_inner]``."""
    Bsz, d_inner, _, _, d_b, _ = _dims(z, xbc, dt, conv_weight, head_dim, d_state, n_groups, d_xb)
    if z_bias is not None:
        z = z + z_bias.to(z.dtype)
    xbc, new_conv = short_conv_with_state(xbc.unsqueeze(1), conv_state, conv_weight, conv_bias, "silu", False)
    conv_state.copy_(new_conv)
    if keep is not None:  # InferenceContext.zero_padding
        xbc = xbc.masked_fill(~keep.view(Bsz, 1, 1), 0)
    x, b, c = xbc.split([d_xb, d_b, n_groups * d_state], dim=-1)
    x, c, k, g = ssd_inputs(x, b, c, dt.unsqueeze(1), dt_bias, A_log, head_dim=head_dim, d_state=d_state,
                            n_groups=n_groups)      # [B,1,H,P], [B,1,H,N] x 2, [B,1,H]
    y, state = gated_recurrence_with_state(c, k, x, g, None, 1.0, ssm_state)
    ssm_state.copy_(state)
    y = torch.addcmul(y, x, D.to(x.dtype).view(-1, 1))
    return gated_rms_norm(y.reshape(Bsz, 1, d_inner), z.unsqueeze(1), norm_weight, norm_eps, activation="swish",
                          norm_before_gate=False, group_size=d_inner // n_groups, triton=False)[:, 0]


# ---------------------------------------------------------------------------------------------- the kernel
# Plain functions handed to triton.jit on first use (``_kernel``), so that importing this module (and so the
# model) never imports triton; ``tl`` is this module's global, bound then (Triton reads the source and resolves
# names in the module's globals when it compiles). ``v.to(DT).to(tl.float32)`` marks where the composed path
# materialises a tensor in dtype DT: the value is rounded there and computed on in fp32, as torch's kernels do.

def _conv_silu(xbc_row, cs_row, s_cs_d, s_cs_w, cw, cb, chan0, o_c, m_c, keep, write,
               W: tl.constexpr, BW: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, CD: tl.constexpr):
    """``conv_step`` + SiLU for the channels ``chan0 + o_c``: the state ``[C, W]`` shifted by the new input (in
    the activations' dtype), ``sum(state * w)`` in the conv's dtype ``CD``, + bias, SiLU; returns the fp32 values
    of that ``CD`` result (0 on a padded row). Writes the shifted state back where ``write`` is nonzero, after a
    barrier: the location of column ``w`` was read (as column ``w + 1`` of the shift) by another thread."""
    ACT: tl.constexpr = xbc_row.dtype.element_ty
    o_w = tl.arange(0, BW)
    chan = chan0 + o_c
    x_new = tl.load(xbc_row + chan, mask=m_c, other=0).to(tl.float32)
    p_old = cs_row + chan[:, None] * s_cs_d + (o_w[None, :] + 1) * s_cs_w
    old = tl.load(p_old, mask=m_c[:, None] & (o_w[None, :] < W - 1), other=0).to(tl.float32)
    s = tl.where(o_w[None, :] == W - 1, x_new[:, None], old.to(ACT).to(tl.float32))  # cat([state[..., 1:], x])
    w = tl.load(cw + chan[:, None] * W + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < W), other=0)
    y = tl.sum((s * w.to(tl.float32)).to(CD).to(tl.float32), axis=1).to(CD).to(tl.float32)  # (state * w).sum(-1)
    if HAS_CONV_BIAS:
        y = (y + tl.load(cb + chan, mask=m_c, other=0).to(tl.float32)).to(CD).to(tl.float32)
    y = (y / (1.0 + tl.exp(-y))).to(CD).to(tl.float32)                                      # silu
    y = tl.where(keep, y, 0.0)                                                              # zero_padding
    tl.debug_barrier()
    # a scalar condition broadcast through a tensor: the interpreter rejects a 0-d term in a mask
    m_st = m_c[:, None] & (o_w[None, :] < W) & ((o_w[None, :] * 0 + write) != 0)
    tl.store(cs_row + chan[:, None] * s_cs_d + o_w[None, :] * s_cs_w, s.to(cs_row.dtype.element_ty), mask=m_st)
    return y


def _mamba2_step_kernel(
    z, xbc, dt, conv_state, ssm_state, conv_w, conv_b, dt_bias, A_log, D, norm_w, z_bias, keep, y,
    s_z, s_xbc, s_dt, s_cs_b, s_cs_d, s_cs_w, s_st_b, s_st_h, s_st_n, s_st_p, s_keep, s_y, eps,
    H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, W: tl.constexpr, D_XB: tl.constexpr, D_B: tl.constexpr,
    R: tl.constexpr, HPG: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, BW: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr, HAS_Z_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr,
):
    """Program (row, B group): heads ``[i_g R HPG, (i_g + 1) R HPG)``, i.e. norm groups ``i_g R .. i_g R + R - 1``
    of ``HPG`` heads each (``R`` = xb_repeat: consecutive heads sharing an x head)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    CD: tl.constexpr = y.dtype.element_ty       # the conv's dtype: x, B, C, the keys, y
    ZD: tl.constexpr = z.dtype.element_ty
    z_row, xbc_row, dt_row, y_row = z + i_b * s_z, xbc + i_b * s_xbc, dt + i_b * s_dt, y + i_b * s_y
    cs_row, st_row = conv_state + i_b * s_cs_b, ssm_state + i_b * s_st_b
    if HAS_KEEP:
        row_keep = tl.load(keep + i_b * s_keep) != 0
    else:
        row_keep = i_b >= 0                     # True, as a tensor like the other branch's
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    o_p = tl.arange(0, BP)

    b_B = _conv_silu(xbc_row, cs_row, s_cs_d, s_cs_w, conv_w, conv_b, D_XB + i_g * N, o_n, m_n, row_keep, 1,
                     W, BW, HAS_CONV_BIAS, CD)
    for r in range(R):
        i_ng = i_g * R + r                      # norm group = C group
        b_C = _conv_silu(xbc_row, cs_row, s_cs_d, s_cs_w, conv_w, conv_b, D_XB + D_B + i_ng * N, o_n, m_n,
                         row_keep, 1, W, BW, HAS_CONV_BIAS, CD)
        sumsq = tl.sum(tl.zeros([BP], dtype=tl.float32), axis=0)
        for j in range(HPG):
            i_h = i_ng * HPG + j
            # softplus(dt + dt_bias), threshold 20; log1p(u) = log(1 + u) * u / ((1 + u) - 1), exact to a few ulp
            # (libdevice's log1p is missing in the interpreter)
            b_dt = tl.load(dt_row + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
            u = tl.exp(b_dt)
            b_dt = tl.where(b_dt > 20.0, b_dt, tl.where(1.0 + u == 1.0, u, tl.log(1.0 + u) * (u / ((1.0 + u) - 1.0))))
            decay = tl.exp(-tl.exp(tl.load(A_log + i_h).to(tl.float32)) * b_dt)
            b_k = (b_B * b_dt.to(CD).to(tl.float32)).to(CD).to(tl.float32)  # dt * B in B's dtype
            b_D = tl.load(D + i_h).to(CD).to(tl.float32)
            x_written = ((i_h % R) == R - 1).to(tl.int32)  # an x head's state: written by its last reader
            for p0 in range(0, P, BP):
                o_v = p0 + o_p
                m_v = o_v < P
                b_x = _conv_silu(xbc_row, cs_row, s_cs_d, s_cs_w, conv_w, conv_b, (i_h // R) * P + p0, o_p, m_v,
                                 row_keep, x_written, W, BW, HAS_CONV_BIAS, CD)
                p_h = st_row + i_h * s_st_h + o_n[:, None] * s_st_n + o_v[None, :] * s_st_p
                m_h = m_n[:, None] & m_v[None, :]
                b_h = tl.load(p_h, mask=m_h, other=0).to(tl.float32)
                b_h = b_h * decay
                b_h += b_k[:, None] * b_x[None, :]
                b_o = tl.sum(b_h * b_C[:, None], axis=0).to(CD).to(tl.float32)  # C^T h, in C's dtype
                b_y = (b_o + b_x * b_D).to(CD).to(tl.float32)                     # addcmul(y, x, D)
                tl.debug_barrier()
                tl.store(p_h, b_h.to(ssm_state.dtype.element_ty), mask=m_h)
                tl.store(y_row + i_h * P + o_v, b_y.to(CD), mask=m_v)  # parked here until the group's norm
                b_z = tl.load(z_row + i_h * P + o_v, mask=m_v, other=0).to(tl.float32)
                if HAS_Z_BIAS:
                    b_zb = tl.load(z_bias + i_h * P + o_v, mask=m_v, other=0).to(ZD).to(tl.float32)
                    b_z = (b_z + b_zb).to(ZD).to(tl.float32)
                b_g = b_y * (b_z / (1.0 + tl.exp(-b_z)))                         # y * silu(z)
                sumsq += tl.sum(tl.where(m_v, b_g * b_g, 0.0), axis=0)
        rstd = tl.rsqrt(sumsq / (HPG * P) + eps)
        tl.debug_barrier()
        for j in range(HPG):
            i_h = i_ng * HPG + j
            for p0 in range(0, P, BP):
                o_v = p0 + o_p
                m_v = o_v < P
                b_y = tl.load(y_row + i_h * P + o_v, mask=m_v, other=0).to(tl.float32)
                b_z = tl.load(z_row + i_h * P + o_v, mask=m_v, other=0).to(tl.float32)
                if HAS_Z_BIAS:
                    b_zb = tl.load(z_bias + i_h * P + o_v, mask=m_v, other=0).to(ZD).to(tl.float32)
                    b_z = (b_z + b_zb).to(ZD).to(tl.float32)
                b_g = b_y * (b_z / (1.0 + tl.exp(-b_z)))
                b_w = tl.load(norm_w + i_h * P + o_v, mask=m_v, other=0).to(tl.float32)
                tl.store(y_row + i_h * P + o_v, (b_g * rstd * b_w).to(CD), mask=m_v)


def _kernel():
    """The jitted kernel, built on first use."""
    global _KERNEL, _conv_silu
    if _KERNEL is None:
        triton = load_triton(globals())
        _conv_silu = triton.jit(_conv_silu)
        _KERNEL = triton.jit(_mamba2_step_kernel)
    return _KERNEL


def mamba2_decode_step(z, xbc, dt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
                       z_bias=None, *, head_dim: int, d_state: int, n_groups: int, d_xb: int, norm_eps: float,
                       keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One cached decode token of a Mamba2 mixer in one Triton kernel (see the module docstring).

    z ``[B, d_inner]``, xbc ``[B, conv_dim]``, dt ``[B, H]``: ``in_proj``'s output for the token (views are fine;
    the last dim must be contiguous). conv_state ``[B, conv_dim, W]`` (any dtype; read as the activations' dtype)
    and ssm_state ``[B, H, N, P]`` (fp32) are updated in place. conv_weight ``[conv_dim, W]``; conv_bias,
    dt_bias, A_log, D, norm_weight, z_bias as the layer holds them (conv_bias / z_bias optional). keep ``[B]``
    bool: False where this token is padding. Returns ``y [B, d_inner]`` in ``promote(xbc, conv_weight)``'s dtype
    (``out_proj``'s input). No autograd."""
    Bsz, d_inner, H, repeat, d_b, conv_dim = _dims(z, xbc, dt, conv_weight, head_dim, d_state, n_groups, d_xb)
    W = conv_weight.shape[-1]
    if conv_state.shape != (Bsz, conv_dim, W) or ssm_state.shape != (Bsz, H, d_state, head_dim):
        raise ValueError(f"mamba2_decode_step: conv_state {tuple(conv_state.shape)} / ssm_state "
                         f"{tuple(ssm_state.shape)} do not fit [B, {conv_dim}, {W}] / [B, {H}, {d_state}, {head_dim}]")
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"mamba2_decode_step: the SSD state must be fp32, got {ssm_state.dtype}")
    if conv_bias is not None and conv_bias.dtype != conv_weight.dtype:
        raise ValueError("mamba2_decode_step: conv weight and bias of different dtypes")
    for name, t in (("z", z), ("xbc", xbc), ("dt", dt)):
        if t.stride(-1) != 1:
            raise ValueError(f"mamba2_decode_step: {name}'s last dim must be contiguous")
    conv_weight = conv_weight.contiguous()
    out_dtype = torch.promote_types(xbc.dtype, conv_weight.dtype)
    y = torch.empty(Bsz, d_inner, dtype=out_dtype, device=z.device)
    BN = _next_pow2(d_state)
    BP = min(_next_pow2(head_dim), max(16, 4096 // BN))
    _kernel()[(Bsz, d_b // d_state)](
        z, xbc, dt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, z_bias, keep, y,
        z.stride(0), xbc.stride(0), dt.stride(0), *conv_state.stride(), *ssm_state.stride(),
        0 if keep is None else keep.stride(0), y.stride(0), float(norm_eps),
        H=H, N=d_state, P=head_dim, W=W, D_XB=d_xb, D_B=d_b, R=repeat, HPG=H // n_groups, BN=BN, BP=BP,
        BW=_next_pow2(W), HAS_CONV_BIAS=conv_bias is not None, HAS_Z_BIAS=z_bias is not None,
        HAS_KEEP=keep is not None, num_warps=max(1, min(4, BN * BP // 256)))
    return y
