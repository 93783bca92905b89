"""Sublayers of the hybrid stack: one mixer per file, functional ops in ``hybridlm.ops``."""
from collections.abc import Mapping

from hybridlm.model.layers.gated_deltanet import GatedDeltaNet
from hybridlm.model.layers.kda import KimiDeltaAttention
from hybridlm.model.layers.mamba2 import Mamba2
from hybridlm.model.layers.mla import MultiHeadLatentAttention
from hybridlm.model.layers.mlp import SwiGLUMLP
from hybridlm.model.layers.norm import RMSNorm
from hybridlm.model.registry import MLP_KIND, mixer_spec, mixers


class _Sublayers(Mapping):
    """kind -> sublayer class: every registered mixer (:mod:`hybridlm.model.registry`) and ``mlp``, read from
    the registry at each lookup."""

    def __getitem__(self, kind):
        return SwiGLUMLP if kind == MLP_KIND else mixer_spec(kind).module

    def __iter__(self):
        return iter([spec.kind for spec in mixers()] + [MLP_KIND])

    def __len__(self):
        return len(mixers()) + 1


SUBLAYERS = _Sublayers()

__all__ = ["SUBLAYERS", "GatedDeltaNet", "KimiDeltaAttention", "Mamba2", "MultiHeadLatentAttention",
           "SwiGLUMLP", "RMSNorm"]
