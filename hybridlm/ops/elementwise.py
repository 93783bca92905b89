"""Small fused pieces shared by the mixers, each with a torch path and a Triton path (the project's kernel where it
has one and ``norm_kernel`` / ``conv_kernel`` is ``"project"``, else fla's).

Every function takes ``triton: bool`` (decided by :func:`hybridlm.ops.backend.use_triton`, or
:func:`~hybridlm.ops.backend.use_triton_elementwise` for the small kernels) so both paths compute the same
function and can be compared directly; the norms take ``norm_kernel`` and the convs ``conv_kernel``, the model's
``runtime.norm_kernel`` / ``runtime.conv_kernel`` (hybridlm/model/runtime.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hybridlm.ops.backend import is_small_inference_call
from hybridlm.ops.causal_conv import causal_conv
from hybridlm.ops.gated_norm import gated_norm_skip, norm_then_gate
from hybridlm.ops.gradient_slots import GradientSlot
from hybridlm.ops.rms_norm import rms_norm_kernel
from hybridlm.ops.swiglu_packed import swiglu_packed_kernel


def _project_norm(x: torch.Tensor, norm_kernel: str) -> bool:
    """The project's norm kernels (hybridlm/ops/rms_norm.py) on the Triton path, except for a decode step's few
    rows: the captured decode step was measured with fla's (docs/decoding.md), ours only at training shapes."""
    return norm_kernel == "project" and not is_small_inference_call(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, triton: bool = False,
             norm_kernel: str = "project") -> torch.Tensor:
    if triton and _project_norm(x, norm_kernel):
        return rms_norm_kernel(x, weight, eps)
    if triton:
        from fla.modules.layernorm import rms_norm as fla_rms_norm
        return fla_rms_norm(x, weight, None, eps=eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 triton: bool = False, norm_kernel: str = "project") -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + delta), x + delta)``: a residual add and the next pre-norm. The Triton kernels (ours and
    fla's) do both in one launch (the sum in fp32, stored in ``x``'s dtype, the norm of the fp32 sum); the torch
    path adds in ``x``'s dtype and normalises that, as a block followed by the next block's norm does."""
    if triton and _project_norm(x, norm_kernel):
        return rms_norm_kernel(x, weight, eps, delta=delta)
    if triton:
        from fla.modules.layernorm import rms_norm as fla_rms_norm
        return fla_rms_norm(delta, weight, None, residual=x, eps=eps, prenorm=True)
    total = x + delta
    return rms_norm(total, weight, eps), total


def _gate(z: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.sigmoid(z) if activation == "sigmoid" else F.silu(z)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "swish", norm_before_gate: bool = True,
                   group_size: Optional[int] = None, triton: bool = False,
                   z_grad_slot: Optional[GradientSlot] = None, norm_kernel: str = "project") -> torch.Tensor:
    """RMSNorm over groups of the last dim of ``x``, gated by ``act(z)`` before or after normalising.

    GDN / KDA: norm first, then gate (``norm(x) * act(z)``) per head (``x``, ``z`` ``[..., heads, head_dim]``,
    ``weight`` ``[head_dim]``); Mamba2: gate first (``norm(x * silu(z))``) per group of ``group_size`` channels.
    On Triton, a SiLU gate after the norm runs the project's kernel (hybridlm/ops/gated_norm.py) under
    ``norm_kernel="project"``, the others fla's.
    ``z_grad_slot``: where the project's kernel writes z's gradient (hybridlm/ops/gradient_slots.py; the other
    paths return it as usual).
    """
    if triton:
        if norm_before_gate and group_size is None:
            if activation in ("swish", "silu") and norm_kernel == "project" and \
                    not x.shape[-1] & (x.shape[-1] - 1):
                # the project's kernel reads z where it lies (a column slice of the fused projection); fla's
                # copies it first
                return norm_then_gate(x.flatten(-2), z.flatten(-2), weight, eps, z_grad_slot).view(x.shape)
            from fla.modules.fused_norm_gate import rms_norm_gated
            return rms_norm_gated(x, z, weight, None, activation=activation, eps=eps)
        if activation in ("swish", "silu"):
            from fla.modules.layernorm_gated import rmsnorm_fn
            return rmsnorm_fn(x, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    dtype = x.dtype
    x, z = x.float(), z.float()
    if not norm_before_gate:
        x = x * _gate(z, activation)
    shape = x.shape
    if group_size is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    x = F.rms_norm(x, (x.shape[-1],), eps=eps).reshape(shape) * weight.float()
    if norm_before_gate:
        x = x * _gate(z, activation)
    return x.to(dtype)


def skip_gated_rms_norm(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                        eps: float, group_size: int, triton: bool = False,
                        z_grad_slot: Optional[GradientSlot] = None, norm_kernel: str = "project") -> torch.Tensor:
    """Mamba2's output stage: ``rms_norm_per_group((y + D_h x) * silu(z)) * weight`` (y, x, z ``[..., C]``, D per
    head). The project's Triton kernel does it in one pass forward and backward (hybridlm/ops/gated_norm.py); the
    other paths add the skip in the activations' dtype (an fp32 sum would be one more fp32 ``[tokens, C]`` tensor
    kept for the norm's backward), then run :func:`gated_rms_norm`."""
    if triton and norm_kernel == "project" and not group_size & (group_size - 1):
        return gated_norm_skip(y, x, D, z, weight, eps, group_size, z_grad_slot)
    shape = y.shape
    heads = D.shape[0]
    y = torch.addcmul(y.reshape(*shape[:-1], heads, -1), x.reshape(*shape[:-1], heads, -1),
                      D.to(x.dtype).view(-1, 1)).reshape(shape)
    return gated_rms_norm(y, z, weight, eps, activation="swish", norm_before_gate=False, group_size=group_size,
                          triton=triton, norm_kernel=norm_kernel)


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               activation: Optional[str] = "silu", triton: bool = False,
               conv_kernel: str = "project") -> torch.Tensor:
    """Depthwise causal convolution over time: x ``[B, T, D]``, weight ``[D, W]``; output ``[B, T, D]``."""
    if triton and conv_kernel == "project" and activation in (None, "silu", "swish"):
        return causal_conv(x, weight, bias, silu=activation is not None)
    if triton:
        from fla.modules.convolution import causal_conv1d
        y, _ = causal_conv1d(x=x, weight=weight, bias=bias, activation=activation)
        return y
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight.unsqueeze(1), bias, groups=weight.shape[0])
    y = y.transpose(1, 2)
    return F.silu(y) if activation in ("silu", "swish") else y


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor] = None, activation: Optional[str] = "silu"):
    """One decoding step of :func:`short_conv`: x ``[B, D]``, conv_state ``[B, D, W]`` (last W inputs)."""
    conv_state = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], dim=-1)
    y = (conv_state * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return (F.silu(y) if activation in ("silu", "swish") else y), conv_state


def short_conv_with_state(x: torch.Tensor, conv_state: Optional[torch.Tensor], weight: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, activation: Optional[str] = "silu",
                          triton: bool = False, conv_kernel: str = "project"):
    """:func:`short_conv` continuing from ``conv_state [B, D, W]`` (the last W inputs, as :func:`conv_step`
    keeps them; None: nothing before, i.e. zeros). Returns ``(y [B, T, D], new conv_state)``."""
    if conv_state is not None and x.shape[1] == 1:
        y, conv_state = conv_step(x[:, 0], conv_state.to(x.dtype), weight, bias, activation)
        return y.unsqueeze(1), conv_state
    B, T, D = x.shape
    W = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(B, D, W)
    # prepend the W - 1 remembered inputs; outputs at those positions are dropped
    ext = torch.cat([conv_state[..., 1:].transpose(1, 2).to(x.dtype), x], dim=1)
    y = short_conv(ext, weight, bias, activation, triton, conv_kernel)[:, W - 1:]
    return y, ext[:, -W:].transpose(1, 2).contiguous()


def swiglu(gate: torch.Tensor, up: torch.Tensor, triton: bool = False) -> torch.Tensor:
    if triton:
        from fla.modules.activations import swiglu as fla_swiglu
        return fla_swiglu(gate, up)
    return F.silu(gate) * up


def swiglu_packed(y: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """:func:`swiglu` of the two halves of one packed projection ``y [..., 2F]`` (gate first, then up); on the
    Triton path its gradient is one ``[..., 2F]`` tensor (hybridlm/ops/swiglu_packed.py)."""
    if triton:
        return swiglu_packed_kernel(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up
