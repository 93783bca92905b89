"""Peers of our models for the benchmarks: fla's GDN / KDA models and a transformers Llama at our shapes."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from benchmarks.harness import flops as F

PEER_BASE = {"fla_gdn": "gdn_300m", "fla_kda": "kda_300m", "llama": "gdn_300m"}


def num_blocks(config) -> int:
    """Sequence-mixer sublayers of a pattern: each peer block is one mixer + one MLP."""
    return sum(1 for k in config.layer_plan if k != "mlp")


def build_peer(kind: str, base, args) -> Tuple[torch.nn.Module, List[F.MixerFlops], Dict[str, Any]]:
    """(model, mixers at ``args.seq`` tokens, its config as a dict) of a peer with ``base``'s shapes."""
    common = dict(hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
                  num_hidden_layers=num_blocks(base), vocab_size=base.vocab_size,
                  tie_word_embeddings=base.tie_word_embeddings, initializer_range=base.initializer_range,
                  bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, use_cache=False)
    if kind in ("fla_gdn", "fla_kda"):
        mixer = "gdn" if kind == "fla_gdn" else "kda"
        a = base.mixer_args(mixer)
        shape = dict(num_heads=a.num_heads, head_dim=a.head_dim, num_v_heads=a.num_v_heads,
                     expand_v=a.head_v_dim / a.head_dim, conv_size=a.conv_size, use_short_conv=True,
                     hidden_act="swish", norm_eps=base.rms_norm_eps, max_position_embeddings=args.seq,
                     fuse_cross_entropy=not args.fla_fused_linear_ce,
                     fuse_linear_cross_entropy=args.fla_fused_linear_ce)
        if kind == "fla_gdn":
            from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
            cfg = GatedDeltaNetConfig(use_gate=True, **shape, **common)
            model = GatedDeltaNetForCausalLM(cfg)
        else:
            from fla.models import KDAConfig, KDAForCausalLM
            cfg = KDAConfig(**shape, **common)
            model = KDAForCausalLM(cfg)
        return model, F.fla_delta_rule_mixers(cfg, mixer, args.seq), cfg.to_diff_dict()
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        heads = max(1, base.hidden_size // 64)
        kv = heads // 4 if heads % 4 == 0 else heads
        cfg = LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv, head_dim=base.hidden_size // heads,
                          max_position_embeddings=args.seq, rms_norm_eps=base.rms_norm_eps,
                          attn_implementation="sdpa", **common)
        model = LlamaForCausalLM(cfg)
        return model, F.llama_mixers(cfg, args.seq), cfg.to_diff_dict()
    raise ValueError(f"unknown peer {kind!r}; expected one of {', '.join(PEER_BASE)}")
