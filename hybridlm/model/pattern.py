"""Parse a hybrid layer pattern (``*-M-M-M-``) into a per-sublayer plan.

One character per sublayer, each wrapped pre-norm + residual:

====== ===============================================================
symbol sublayer
====== ===============================================================
``*``  MLA attention
``M``  the configured linear mixer (``mixer: mamba2 | gdn | kda``)
``G``  Gated DeltaNet, whatever ``mixer`` says
``K``  Kimi Delta Attention, whatever ``mixer`` says
``S``  Mamba2 (selective SSM), whatever ``mixer`` says
``-``  SwiGLU MLP
====== ===============================================================

The explicit letters let one stack mix mixer types, e.g. ``*-G-S-K-``. Every mixer symbol is read from the
mixer registry (:mod:`hybridlm.model.registry`); a registered mixer brings its own letter.
"""
from __future__ import annotations

from typing import List, Optional

from hybridlm.config.errors import ConfigError
from hybridlm.model.registry import (CONFIGURED_SYMBOL, LATENT, MLP_KIND, MLP_SYMBOL, cache_of, check_kind, is_mixer,
                                     kind_of_symbol, pattern_symbols)


def attention_positions(num_mixer_blocks: int, ratio: float) -> List[int]:
    """Mixer-block indices that become MLA for a given attention ratio, spread evenly from block 0.

    ratio 0.25 over 12 blocks gives [0, 4, 8], the Primus recipe's 75 % hybrid ``*-M-M-M-*-M-M-M-*-M-M-M-``.
    """
    n_attn = round(ratio * num_mixer_blocks)
    if n_attn == 0:
        return []
    return sorted({(i * num_mixer_blocks) // n_attn for i in range(n_attn)})


def pattern_from_ratio(num_layers: int, ratio: float) -> str:
    """Alternating mixer / MLP sublayers with MLA placed by :func:`attention_positions`."""
    if num_layers % 2:
        raise ConfigError(f"num_layers: {num_layers} must be even to build a pattern from hybrid_attention_ratio "
                          "(mixer and MLP sublayers alternate); give hybrid_override_pattern instead")
    n_blocks = num_layers // 2
    attn = set(attention_positions(n_blocks, ratio))
    return "".join(("*" if b in attn else "M") + "-" for b in range(n_blocks))


def parse_pattern(pattern: str, num_layers: Optional[int], mixer: str,
                  attention_ratio: Optional[float] = None) -> List[str]:
    """Validate ``pattern`` and return the layer plan, e.g. ``["mla", "mlp", "gdn", "mlp"]``."""
    check_kind(mixer)
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError("hybrid_override_pattern: must be a non-empty string such as '*-M-M-M-'")
    plan = []
    for i, ch in enumerate(pattern):
        kind = mixer if ch == CONFIGURED_SYMBOL else MLP_KIND if ch == MLP_SYMBOL else kind_of_symbol(ch)
        if kind is None:
            raise ConfigError(f"hybrid_override_pattern: unknown symbol {ch!r} at position {i}; "
                              f"expected one of {pattern_symbols()} (pattern {pattern!r})")
        plan.append(kind)
    if num_layers is not None and len(pattern) != num_layers:
        raise ConfigError(f"hybrid_override_pattern: length {len(pattern)} does not match num_layers {num_layers}")
    if attention_ratio is not None:
        n_seq = sum(is_mixer(kind) for kind in plan)
        n_attn = sum(cache_of(kind) == LATENT for kind in plan)  # attention: the mixers with a per-token cache
        if n_seq == 0 or round(attention_ratio * n_seq) != n_attn:
            raise ConfigError(f"hybrid_attention_ratio: {attention_ratio} disagrees with hybrid_override_pattern, "
                              f"which has {n_attn} MLA of {n_seq} sequence-mixer sublayers")
    if not any(is_mixer(kind) for kind in plan):
        raise ConfigError(f"hybrid_override_pattern: has no sequence mixer (any of {pattern_symbols()[:-2]}); "
                          "tokens could not interact")
    return plan


# --------------------------------------------------------------------------------------- validation
def student_kinds(cfg, who: str) -> List[str]:
    """The mixer kind of every teacher layer of a student (its plan must alternate mixer / MLP)."""
    plan = list(cfg.layer_plan)
    if len(plan) % 2 or any(not is_mixer(k) for k in plan[0::2]) or any(k != MLP_KIND for k in plan[1::2]):
        raise ConfigError(f"{who}: pattern {cfg.hybrid_override_pattern!r} is not an upcycled student "
                          f"(expected alternating mixer / MLP sublayers, one pair per teacher layer)")
    return plan[0::2]
