"""RMSNorm module (fla's fused kernel on GPU, torch on CPU)."""
import torch
from torch import nn

from hybridlm.ops.backend import use_triton_elementwise
from hybridlm.ops.elementwise import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, backend: str = "auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, triton=use_triton_elementwise(self.backend, x))
