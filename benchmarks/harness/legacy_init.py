"""The toolkit's previous initialisation, part by part, for the loss-parity ablation (docs/initialisation.md):
``apply_legacy_init`` puts those parts of a freshly built model back to how they were initialised before."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from hybridlm.model.layers.conv import ShortConv
from hybridlm.model.layers.init import init_short_conv, init_short_conv_uniform
from hybridlm.model.layers.mamba2 import Mamba2

# the parts of the toolkit's first initialisation (``--ours-init legacy`` puts all of them back) ...
LEGACY_PARTS = ("conv", "conv_bias", "mamba2_out_proj")
# ... and of a later one: Mamba2's conv as fla initialises it (our default until it was measured to learn slower)
KNOWN_PARTS = LEGACY_PARTS + ("mamba2_conv_fla",)


def check_legacy_parts(parts: Iterable[str]) -> list:
    parts = list(parts)
    bad = [p for p in parts if p not in KNOWN_PARTS]
    if bad:
        raise ValueError(f"legacy init parts: unknown {', '.join(bad)}; expected some of {', '.join(KNOWN_PARTS)}")
    return parts


@torch.no_grad()
def apply_legacy_init(model: nn.Module, parts: Sequence[str] = LEGACY_PARTS, initializer_range: float = 0.02) -> list:
    """Re-initialise ``parts`` of a freshly built model the way this toolkit did before (names in
    :data:`LEGACY_PARTS`): ``conv`` every short-conv weight, ``conv_bias`` every short-conv bias (Mamba2's),
    both PyTorch's Conv1d default; ``mamba2_out_proj`` Mamba2's out_proj normal(0, initializer_range);
    ``mamba2_conv_fla`` Mamba2's conv as fla initialises it (weight normal(0, initializer_range), bias 0: this
    toolkit's default until Mamba2's conv went back to PyTorch's default).
    Returns the names of the parameters it touched."""
    parts = set(check_legacy_parts(parts))
    touched = []
    for name, module in model.named_modules():
        if isinstance(module, ShortConv):
            if "conv" in parts:
                init_short_conv_uniform(module, weight=True, bias=False)
                touched.append(f"{name}.weight")
            if "conv_bias" in parts and module.bias is not None:
                init_short_conv_uniform(module, weight=False, bias=True)
                touched.append(f"{name}.bias")
        elif isinstance(module, Mamba2):
            if "mamba2_out_proj" in parts:
                nn.init.normal_(module.out_proj.weight, mean=0.0, std=initializer_range)
                touched.append(f"{name}.out_proj.weight")
            if "mamba2_conv_fla" in parts:
                init_short_conv(module.conv1d, initializer_range)
                touched.append(f"{name}.conv1d.weight")
                if module.conv1d.bias is not None:
                    touched.append(f"{name}.conv1d.bias")
    return touched
