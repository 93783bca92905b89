"""SwiGLU feed-forward sublayer: down(silu(gate(x)) * up(x))."""
from typing import Optional

import torch
from torch import nn

from hybridlm.model.layers.projections import fused_linear
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.ops.backend import use_triton_elementwise
from hybridlm.ops.elementwise import swiglu, swiglu_packed


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, runtime: Optional[RuntimeSettings] = None):
        """``runtime``: the model's settings, read when it runs (None: the defaults)."""
        super().__init__()
        d, f = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.runtime = RuntimeSettings() if runtime is None else runtime  # model.set_runtime replaces it

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:  # position-wise: nothing to cache or mask
        triton = use_triton_elementwise(self.runtime.backend, x)
        # training: gate and up as one GEMM, SwiGLU over its packed output (hybridlm/model/layers/projections.py)
        packed = fused_linear(x, (self.gate_proj, self.up_proj)) if self.runtime.fuse_projections else None
        if packed is not None:
            return self.down_proj(swiglu_packed(packed, triton))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), triton=triton))
