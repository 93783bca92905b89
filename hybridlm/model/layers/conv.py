"""Depthwise causal short convolution parameters (the op lives in ``hybridlm.ops.elementwise``)."""
import math

import torch
from torch import nn

from hybridlm.ops.elementwise import short_conv, short_conv_with_state


class ShortConv(nn.Module):
    """Holds a depthwise kernel ``weight [dim, width]`` (and optional bias), initialised like nn.Conv1d."""

    def __init__(self, dim: int, width: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, width))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.reset_parameters()

    @property
    def state_shape(self) -> tuple:
        """Per-sequence shape of its cached state ``[dim, width]`` (the last ``width`` inputs)."""
        return tuple(self.weight.shape)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])  # fan_in of a depthwise conv is its width
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)


def run_short_conv(conv: ShortConv, x: torch.Tensor, triton: bool, cache=None, name: str = "conv") -> torch.Tensor:
    """``silu(conv(x))``; with a :class:`~hybridlm.model.cache.RecurrentCacheLayer` the conv continues from
    (and updates) its conv state ``name`` (in place for a static cache)."""
    if cache is None:
        return short_conv(x, conv.weight, conv.bias, "silu", triton)
    y, state = short_conv_with_state(x, cache.conv_states.get(name), conv.weight, conv.bias, "silu", triton)
    cache.set_conv(name, state)
    return y
