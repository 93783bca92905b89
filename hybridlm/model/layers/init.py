"""Initial values of the mixers' own parameters, shared by Mamba2, GDN and KDA (docs/initialisation.md).

From scratch every mixer is initialised as flash-linear-attention's models are (``fla/models/*/modeling_*.py``
``_init_weights``): projections, short convolutions and embeddings normal(0, ``initializer_range``), biases 0,
norm weights 1; A_log / dt_bias as below; Mamba2's ``out_proj`` also gets the depth-scaled uniform init that
fla's (and mamba_ssm's) Mamba2 uses. One exception: Mamba2's conv keeps PyTorch's Conv1d default
(:func:`init_short_conv_uniform`), as mamba_ssm, Megatron and transformers have it. fla's normal(0, 0.02) makes
its B, C and x so small that the SSD's output starts at 1e-4 of the D skip's, and the model learned 0.10 nats
slower in 300 steps (docs/initialisation.md); GDN and KDA L2-normalise q and k after the conv, so fla's small
conv suits them.

The alternatives the loss-parity ablation compares, part by part (PyTorch's Conv1d default for every short conv
and its bias, normal(0, ``initializer_range``) for Mamba2's ``out_proj``, fla's conv for Mamba2), are
:mod:`benchmarks.harness.legacy_init`.
"""
import math

import torch
from torch import nn


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


def init_short_conv_uniform(conv, weight: bool = True, bias: bool = True) -> None:
    """PyTorch's ``nn.Conv1d`` default for a depthwise kernel (fan-in = width): weight and bias
    U(-1/sqrt(width), 1/sqrt(width)), std ~0.29 at width 4. Mamba2's conv (mamba_ssm, Megatron and transformers
    leave their ``nn.Conv1d`` at this default)."""
    bound = 1.0 / math.sqrt(conv.weight.shape[-1])
    with torch.no_grad():
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


