"""RMSNorm module (a fused Triton kernel on GPU: hybridlm/ops/elementwise.py ``rms_norm``; torch on CPU)."""
from typing import Optional

import torch
from torch import nn

from hybridlm.model.runtime import RuntimeSettings
from hybridlm.ops.backend import use_triton_elementwise
from hybridlm.ops.elementwise import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, runtime: Optional[RuntimeSettings] = None):
        """``runtime``: the model's settings (read when it runs); None: a norm of its own with the defaults."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.runtime = RuntimeSettings() if runtime is None else runtime

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, triton=use_triton_elementwise(self.runtime.backend, x),
                        norm_kernel=self.runtime.norm_kernel)

    def add_and_normalise(self, x: torch.Tensor, delta: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + delta), x + delta)``, one kernel on the fused path; ``delta=None``: ``(self(x), x)``."""
        if delta is None:
            return self(x), x
        return add_rms_norm(x, delta, self.weight, self.eps, triton=use_triton_elementwise(self.runtime.backend, x),
                            norm_kernel=self.runtime.norm_kernel)
