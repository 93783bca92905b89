"""Initial values of the mixers' own parameters, shared by Mamba2, GDN and KDA (docs/initialisation.md).

From scratch every mixer is initialised as flash-linear-attention's models are (``fla/models/*/modeling_*.py``
``_init_weights``): projections, short convolutions and embeddings normal(0, ``initializer_range``), biases 0,
norm weights 1; A_log / dt_bias as below; Mamba2's ``out_proj`` also gets the depth-scaled uniform init that
fla's (and mamba_ssm's) Mamba2 uses.

:func:`apply_legacy_init` puts back what this toolkit did before, part by part (PyTorch's ``nn.Conv1d``
default on the short convolutions, normal ``out_proj`` in Mamba2), for ablations of the loss-parity benchmark.
"""
import math
from typing import Iterable, Sequence

import torch
from torch import nn

# the parts apply_legacy_init can put back to the previous initialisation
LEGACY_PARTS = ("conv", "conv_bias", "mamba2_out_proj")


def init_A_log(param: torch.Tensor, low: float = 1.0, high: float = 16.0) -> None:
    """A = -exp(A_log) with A ~ U(low, high): the Mamba2 decay-rate init."""
    with torch.no_grad():
        param.copy_(torch.empty_like(param).uniform_(low, high).log())


def init_dt_bias(param: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 1e-1, floor: float = 1e-4) -> None:
    """softplus(dt_bias) = dt with dt log-uniform in [dt_min, dt_max], floored (inverse softplus)."""
    with torch.no_grad():
        dt = torch.exp(torch.rand_like(param) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=floor)
        param.copy_(dt + torch.log(-torch.expm1(-dt)))


def init_short_conv(conv, std: float) -> None:
    """fla's init of a short convolution (``ShortConvolution`` is an ``nn.Conv1d``, so its ``_init_weights``
    treats it as one): weight normal(0, std), bias 0."""
    nn.init.normal_(conv.weight, mean=0.0, std=std)
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def init_short_conv_legacy(conv, weight: bool = True, bias: bool = True) -> None:
    """PyTorch's ``nn.Conv1d`` default for a depthwise kernel (fan-in = width): weight and bias
    U(-1/sqrt(width), 1/sqrt(width)), std ~0.29 for width 4. What ``ShortConv`` used before."""
    bound = 1.0 / math.sqrt(conv.weight.shape[-1])
    if weight:
        nn.init.uniform_(conv.weight, -bound, bound)
    if bias and conv.bias is not None:
        nn.init.uniform_(conv.bias, -bound, bound)


def init_residual_out_proj(linear: nn.Linear, num_residuals: int) -> None:
    """``kaiming_uniform_(a=sqrt(5))`` divided by sqrt(num_residuals): U(-b, b) with b = 1 / sqrt(fan_in *
    num_residuals). fla's Mamba2 ``_init_weights`` with ``rescale_prenorm_residual`` (its default) does this to
    ``out_proj`` with num_residuals = number of layers; one call (no in-place division) so that transformers'
    guard against re-initialising loaded weights covers it."""
    bound = 1.0 / math.sqrt(linear.weight.shape[1] * max(1, num_residuals))
    nn.init.uniform_(linear.weight, -bound, bound)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def check_legacy_parts(parts: Iterable[str]) -> list:
    parts = list(parts)
    bad = [p for p in parts if p not in LEGACY_PARTS]
    if bad:
        raise ValueError(f"legacy init parts: unknown {', '.join(bad)}; expected some of {', '.join(LEGACY_PARTS)}")
    return parts


@torch.no_grad()
def apply_legacy_init(model: nn.Module, parts: Sequence[str] = LEGACY_PARTS, initializer_range: float = 0.02) -> list:
    """Re-initialise ``parts`` of a freshly built model the way this toolkit did before (names in
    :data:`LEGACY_PARTS`): ``conv`` every short-conv weight, ``conv_bias`` every short-conv bias (Mamba2's),
    both PyTorch's Conv1d default; ``mamba2_out_proj`` Mamba2's out_proj normal(0, initializer_range).
    Returns the names of the parameters it touched."""
    from hybridlm.model.layers.conv import ShortConv
    from hybridlm.model.layers.mamba2 import Mamba2

    parts = set(check_legacy_parts(parts))
    touched = []
    for name, module in model.named_modules():
        if isinstance(module, ShortConv):
            if "conv" in parts:
                init_short_conv_legacy(module, weight=True, bias=False)
                touched.append(f"{name}.weight")
            if "conv_bias" in parts and module.bias is not None:
                init_short_conv_legacy(module, weight=False, bias=True)
                touched.append(f"{name}.bias")
        elif isinstance(module, Mamba2) and "mamba2_out_proj" in parts:
            nn.init.normal_(module.out_proj.weight, mean=0.0, std=initializer_range)
            touched.append(f"{name}.out_proj.weight")
    return touched
