"""SwiGLU feed-forward sublayer: down(silu(gate(x)) * up(x))."""
import torch
from torch import nn

from hybridlm.ops.backend import use_triton_elementwise
from hybridlm.ops.elementwise import swiglu


class SwiGLUMLP(nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.backend = config.backend

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:  # position-wise: nothing to cache or mask
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), triton=use_triton_elementwise(self.backend, x)))
