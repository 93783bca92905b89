"""Depthwise causal short convolution parameters (the op lives in ``hybridlm.ops.elementwise``)."""
import math

import torch
from torch import nn


class ShortConv(nn.Module):
    """Holds a depthwise kernel ``weight [dim, width]`` (and optional bias), initialised like nn.Conv1d."""

    def __init__(self, dim: int, width: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, width))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])  # fan_in of a depthwise conv is its width
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)
