"""Sublayers of the hybrid stack: one mixer per file (its settings, module, costs, init and registry entry),
functional ops in ``hybridlm.ops``.

The built-in mixers register themselves when their files are imported, here, in the order of their config sections
and reports: MLA, GDN, KDA, Mamba2.
"""
from collections.abc import Mapping

from hybridlm.model.layers.mla import MLAArgs, MultiHeadLatentAttention  # isort: skip (registration order)
from hybridlm.model.layers.gated_deltanet import GatedDeltaNet  # isort: skip
from hybridlm.model.layers.kda import KimiDeltaAttention  # isort: skip
from hybridlm.model.layers.mamba2 import Mamba2, Mamba2Args  # isort: skip
from hybridlm.model.layers.delta_rule import DeltaRuleArgs
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


def build_sublayer(config, kind: str, layer_idx: int = 0):
    """Sublayer ``layer_idx`` of ``config`` (a ``HybridConfig``), of ``kind``: a registered mixer built from its own
    settings (:meth:`~hybridlm.model.registry.MixerSpec.build`) or the MLP; the one place a layer meets the whole
    config."""
    if kind == MLP_KIND:
        return SwiGLUMLP(config.hidden_size, config.intermediate_size, config.runtime)
    return mixer_spec(kind).build(config, layer_idx)


__all__ = ["SUBLAYERS", "build_sublayer", "GatedDeltaNet", "KimiDeltaAttention", "Mamba2", "MultiHeadLatentAttention",
           "SwiGLUMLP", "RMSNorm", "MLAArgs", "DeltaRuleArgs", "Mamba2Args"]
