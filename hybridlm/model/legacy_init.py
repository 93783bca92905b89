"""The toolkit's previous initialisation, part by part, for the loss-parity ablation (docs/initialisation.md):
``apply_legacy_init`` puts those parts of a freshly built model back to how they were initialised before."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from torch import nn

from hybridlm.model.layers.conv import ShortConv
from hybridlm.model.layers.mamba2 import Mamba2

# the parts apply_legacy_init can put back to the previous initialisation
LEGACY_PARTS = ("conv", "conv_bias", "mamba2_out_proj")


def init_short_conv_legacy(conv, weight: bool = True, bias: bool = True) -> None:
    """PyTorch's ``nn.Conv1d`` default for a depthwise kernel (fan-in = width): weight and bias
    U(-1/sqrt(width), 1/sqrt(width)), std ~0.29 for width 4. What ``ShortConv`` used before."""
    bound = 1.0 / math.sqrt(conv.weight.shape[-1])
    if weight:
        nn.init.uniform_(conv.weight, -bound, bound)
    if bias and conv.bias is not None:
        nn.init.uniform_(conv.bias, -bound, bound)


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
