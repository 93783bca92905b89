"""Several linear projections of one input as one GEMM, in training.

A mixer that projects its input six ways (GDN: q, k, v, beta, the decay and the output gate) runs six GEMMs
forward, and backward six input-gradient GEMMs whose results autograd adds up one by one (five full-size adds of
``[tokens, hidden]`` per layer), plus six weight-gradient GEMMs that each re-read the input. One GEMM over the
concatenated weights does the same work with one input gradient and one weight gradient (split back onto each
``weight`` by autograd). The parameters stay the separate ``nn.Linear`` modules they are (state dicts, inits and
upcycling maps unchanged); only the call is fused. docs/design.md, "Fused training paths".
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops.gradient_slots import split_columns


def fusable(linears: Sequence[nn.Module]) -> bool:
    """Plain ``nn.Linear`` modules without hooks, with materialised weights (not ZeRO-3 partitions) of one dtype,
    all with a bias or all without: calling ``F.linear`` on their concatenated weights is their own function."""
    if len(linears) < 2 or any(type(m) is not nn.Linear for m in linears):
        return False
    if any(m._forward_hooks or m._forward_pre_hooks or hasattr(m.weight, "ds_id") for m in linears):
        return False
    if len({m.weight.dtype for m in linears}) != 1 or len({m.weight.device for m in linears}) != 1:
        return False
    return len({m.bias is None for m in linears}) == 1


def fused_linear(x: torch.Tensor, linears: Sequence[nn.Module]) -> Optional[torch.Tensor]:
    """``cat([m(x) for m in linears], -1)`` through one GEMM, or None where that does not pay or does not apply:
    outside autograd (generation: the concatenation would copy the weights at every step) or when the modules
    are not :func:`fusable`."""
    if not torch.is_grad_enabled() or not fusable(linears):
        return None
    weight = torch.cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return F.linear(x, weight, bias)


def project(x: torch.Tensor, linears: Sequence[nn.Module], fuse: bool = True, join_first: int = 1,
            grads_in_place: bool = False) -> list:
    """``[m(x) for m in linears]``; with ``fuse``, through :func:`fused_linear` where it applies (the outputs are
    then views of one tensor: last dim contiguous, rows strided). Where it applies and ``join_first > 1``, the first
    ``join_first`` outputs come as one view, their columns side by side (for one kernel over them), in place of
    ``join_first`` views: the list is then ``join_first - 1`` shorter. With ``grads_in_place`` the views come from
    :func:`hybridlm.ops.gradient_slots.split_columns`: each carries the slot its consumer may write its gradient
    into, and the GEMM's output gradient is assembled there instead of concatenated."""
    y = fused_linear(x, linears) if fuse else None
    if y is None:
        return [m(x) for m in linears]
    widths = [m.out_features for m in linears]
    widths = [sum(widths[:join_first]), *widths[join_first:]]
    return split_columns(y, widths)[0] if grads_in_place else list(y.split(widths, dim=-1))
