"""Initial values of the recurrent-decay parameters shared by Mamba2, GDN and KDA."""
import math

import torch


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
