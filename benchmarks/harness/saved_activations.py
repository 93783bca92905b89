"""Bytes that autograd keeps for the backward, per token, for each sublayer: the activation memory of training.

    python -m benchmarks.harness.saved_activations [--kinds mamba2 gdn ...] [--seq 256] [--dtype bf16]

Runs forwards of each sublayer (the Primus recipe's 300M shapes, torch path, so it works on CPU) under
``torch.autograd.graph.saved_tensors_hooks`` and sums the distinct storages packed for the backward,
parameters excluded, at two lengths: what grows with the length is per token, the rest per step. The
recurrences' internals differ between the torch and the Triton path, the element-wise work around them
(projections, gates, skips, casts) is the same code on both, so a change there shows here with the size it
has on the GPU. Prints one JSON line per sublayer.
"""
from __future__ import annotations

import argparse
from typing import Dict

import torch

from benchmarks.harness.mixers import SHAPES_300M
from hybridlm.model import HybridConfig
from hybridlm.model.layers import SUBLAYERS, build_sublayer
from hybridlm.utils.atomic import json_text

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _kept_bytes(layer, config, seq: int, dtype: torch.dtype, params: set) -> int:
    """Bytes of the distinct non-parameter storages autograd packs in one forward of ``layer`` over ``seq`` tokens."""
    kept: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    x = torch.randn(1, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values())


def saved_bytes_per_token(kind: str, seq: int = 256, dtype: torch.dtype = torch.bfloat16) -> Dict[str, float]:
    """``bytes_per_token`` kept for the backward by one forward of sublayer ``kind`` (batch 1), from forwards over
    ``seq`` and ``2 * seq`` tokens, and ``bytes_per_step``, what it keeps whatever the length (the concatenated
    weights of a fused projection: hybridlm/model/layers/projections.py)."""
    torch.manual_seed(0)
    config = HybridConfig(**{**SHAPES_300M, "vocab_size": 512, "runtime": {"backend": "torch"}})
    layer = build_sublayer(config, kind).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    one, two = (_kept_bytes(layer, config, n, dtype, params) for n in (seq, 2 * seq))
    return {"sublayer": kind, "seq": seq, "dtype": str(dtype).split(".")[-1],
            "bytes_per_token": (two - one) / seq, "bytes_per_step": 2 * one - two}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.saved_activations", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=list(SUBLAYERS), choices=list(SUBLAYERS))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = p.parse_args(argv)
    for kind in args.kinds:
        print(json_text(saved_bytes_per_token(kind, args.seq, DTYPES[args.dtype])), flush=True)


if __name__ == "__main__":
    main()
