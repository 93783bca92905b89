"""Sublayers of the hybrid stack: one mixer per file, functional ops in ``hybridlm.ops``."""
from hybridlm.model.layers.gated_deltanet import GatedDeltaNet
from hybridlm.model.layers.kda import KimiDeltaAttention
from hybridlm.model.layers.mamba2 import Mamba2
from hybridlm.model.layers.mla import MultiHeadLatentAttention
from hybridlm.model.layers.mlp import SwiGLUMLP
from hybridlm.model.layers.norm import RMSNorm

SUBLAYERS = {
    "mla": MultiHeadLatentAttention,
    "gdn": GatedDeltaNet,
    "kda": KimiDeltaAttention,
    "mamba2": Mamba2,
    "mlp": SwiGLUMLP,
}

__all__ = ["SUBLAYERS", "GatedDeltaNet", "KimiDeltaAttention", "Mamba2", "MultiHeadLatentAttention",
           "SwiGLUMLP", "RMSNorm"]
