"""Depthwise causal short convolution parameters (the op lives in ``hybridlm.ops.elementwise``)."""
import torch
from torch import nn

from hybridlm.model.layers.init import init_short_conv
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.ops.elementwise import short_conv, short_conv_with_state


class ShortConv(nn.Module):
    """Holds a depthwise kernel ``weight [dim, width]`` (and optional bias), initialised as fla initialises its
    ``ShortConvolution``: weight normal(0, std) with the model's ``initializer_range`` (set by the model's
    ``_init_weights``; 0.02 standalone), bias 0. Mamba2 re-draws its conv with PyTorch's Conv1d default (std ~0.29
    at width 4: :func:`hybridlm.model.layers.init.init_short_conv_uniform`)."""

    def __init__(self, dim: int, width: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, width))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.reset_parameters()

    @property
    def state_shape(self) -> tuple:
        """Per-sequence shape of its cached state ``[dim, width]`` (the last ``width`` inputs)."""
        return tuple(self.weight.shape)

    def reset_parameters(self, std: float = 0.02) -> None:
        init_short_conv(self, std)


def recurrent_context(ctx, layer_idx: int, x: torch.Tensor):
    """``(cache, x)`` for a recurrent mixer's forward: outside generation ``(None, x)``; in generation
    (``ctx`` an :class:`~hybridlm.model.cache.InferenceContext`) the layer's cached conv / recurrent states and
    ``x`` with padded positions zeroed."""
    if ctx is None:
        return None, x
    return ctx.layer(layer_idx), ctx.zero_padding(x)


def split_conv_applies(runtime: RuntimeSettings, triton: bool, cache) -> bool:
    """Whether a mixer runs its conv through ``causal_conv_split`` (hybridlm/ops/causal_conv.py):
    ``runtime.split_conv_outputs`` on, on the Triton path with the project's conv kernel (``runtime.conv_kernel``),
    outside generation (whose conv continues from cached states, which the split conv does not take)."""
    return runtime.split_conv_outputs and triton and cache is None and runtime.conv_kernel == "project"


def run_short_conv(conv: ShortConv, x: torch.Tensor, triton: bool, cache=None, name: str = "conv",
                   conv_kernel: str = "project") -> torch.Tensor:
    """``silu(conv(x))``; with a :class:`~hybridlm.model.cache.RecurrentCacheLayer` the conv continues from
    (and updates) its conv state ``name`` (in place for a static cache). ``conv_kernel``: the model's
    ``runtime.conv_kernel``."""
    if cache is None:
        return short_conv(x, conv.weight, conv.bias, "silu", triton, conv_kernel)
    y, state = short_conv_with_state(x, cache.conv_states.get(name), conv.weight, conv.bias, "silu", triton,
                                     conv_kernel)
    cache.set_conv(name, state)
    return y
