"""Parameter counts and the layer plan of a config, computed on the meta device (no memory, no init cost)."""
from __future__ import annotations

from typing import Any, Dict

import torch

from hybridlm.model.configuration import HybridConfig
from hybridlm.model.modeling import HybridForCausalLM


def build_on_meta(config: HybridConfig) -> HybridForCausalLM:
    with torch.device("meta"):
        return HybridForCausalLM(config)


def model_summary(config: HybridConfig) -> Dict[str, Any]:
    model = build_on_meta(config)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    if not config.tie_word_embeddings:
        embedding += model.lm_head.weight.numel()
    by_kind: Dict[str, int] = {}
    for block in model.model.layers:
        by_kind[block.kind] = by_kind.get(block.kind, 0) + sum(p.numel() for p in block.parameters())
    return {
        "params": params,
        "non_embedding_params": params - embedding,
        "params_by_sublayer": by_kind,
        "layer_plan": list(config.layer_plan),
        "hybrid_override_pattern": config.hybrid_override_pattern,
        "mixer": config.mixer,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
