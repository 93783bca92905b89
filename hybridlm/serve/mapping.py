"""What vLLM runs of an export: the layers it can serve, the attention head size, and the export's weights
renamed and re-laid out for vLLM's layers.

No vLLM import here: the checks and the weight mapping are plain torch, so they are tested without vLLM.

Which mixers vLLM serves, and how each one's weights map, the registry says (``serve_layer`` / ``serve_weights``
of a mixer's entry, hybridlm/model/registry.py); the MLP, not a mixer, is mapped here.

Mamba2 with ``d_xb`` (MambaInLlama: x and B projected to fewer channels and shared by consecutive heads, as
grouped-query attention shares keys) becomes vLLM's plain Mamba2 layout by repeating those rows of ``in_proj``
and those channels of the depthwise conv: the conv acts per channel, so a repeated channel convolved equals the
convolved channel repeated, and the scan then sees exactly the x and B our layer broadcasts to its heads.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.model.registry import CONFIGURED_SYMBOL, MLP_KIND, MLP_SYMBOL, load_object, mixer_spec, mixers, symbol_of

# the head sizes vLLM's CPU attention kernel takes (CPUAttentionBackend.get_supported_head_sizes in vLLM 0.32;
# the CUDA backends take all of them up to 256): MLA's query/key and value heads are zero-padded to the
# smallest that fits, which changes no score (the pad adds 0 to every dot product) and no output (sliced off)
ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.mixer\.(.+)")
# how the MLA layers keep their cache in vLLM: "heads" (per-head keys and values decompressed by kv_b, on vLLM's
# paged attention; tested on CPU) or "latent" (the latent and the shared RoPE key, on vLLM's MLA backends: CUDA,
# fp16 / bf16)
MLA_CACHE_ENV = "HYBRIDLM_VLLM_MLA_CACHE"
MLA_CACHES = ("heads", "latent")


def _where(config) -> str:
    """The export's config.json for messages (the config's own path when it was loaded from a folder)."""
    source = getattr(config, "name_or_path", "") or ""
    return f"{Path(source) / 'config.json'}: " if source else ""


def served_kinds() -> list:
    """The sublayer kinds vLLM runs: the registered mixers with a ``serve_layer``, and the MLP."""
    return [spec.kind for spec in mixers() if spec.serve_layer is not None] + [MLP_KIND]


def _served_names() -> str:
    """``MLA ('*'), Mamba2 ('S', or 'M' with mixer: mamba2) and MLP ('-')`` for the built-in mixers."""
    names = [f"{spec.name} ({spec.symbol!r}" + (f", or {CONFIGURED_SYMBOL!r} with mixer: {spec.kind})" if spec.linear
                                                 else ")")
             for spec in mixers() if spec.serve_layer is not None]
    return f"{', '.join(names)} and MLP ({MLP_SYMBOL!r})"


def check_servable(config) -> None:
    """ConfigError (one line naming config.json and the field) unless vLLM can run every layer of ``config`` and
    it has both MLA and Mamba2 layers."""
    where = _where(config)
    served = served_kinds()
    for i, kind in enumerate(config.layer_plan):
        if kind not in served:
            title = mixer_spec(kind).name
            raise ConfigError(
                f"{where}hybrid_override_pattern: layer {i} is {title} ({symbol_of(kind)!r}); serving with vLLM "
                f"runs {_served_names()} layers only")
    for kind, name in (("mla", "MLA ('*')"), ("mamba2", "Mamba2")):
        if kind not in config.layer_plan:
            # vLLM decides per architecture whether a model is hybrid (attention pages sized to the Mamba2 state)
            raise ConfigError(f"{where}hybrid_override_pattern: {config.hybrid_override_pattern!r} has no {name} "
                              f"layer; serving with vLLM takes stacks with both MLA and Mamba2 layers")
    attention_head_size(config)
    _mamba2_widths(config.mixer_args("mamba2"), where)


def attention_head_size(config) -> int:
    """The padded head size MLA runs at on vLLM's attention: the smallest supported size holding both the
    query/key head (``qk_nope_head_dim + qk_rope_head_dim``) and the value head."""
    a = config.mixer_args("mla")
    need = max(a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)
    for size in ATTENTION_HEAD_SIZES:
        if size >= need:
            return size
    raise ConfigError(f"{_where(config)}mla: qk_nope_head_dim + qk_rope_head_dim "
                      f"({a.qk_nope_head_dim + a.qk_rope_head_dim}) and v_head_dim ({a.v_head_dim}) must be at "
                      f"most {ATTENTION_HEAD_SIZES[-1]} to run on vLLM's attention")


def mla_cache_mode() -> str:
    """The MLA cache this process serves with (``$HYBRIDLM_VLLM_MLA_CACHE``, default ``heads``); ConfigError for
    another value. vLLM starts its engine processes with the server's environment, so every process reads the same."""
    mode = os.environ.get(MLA_CACHE_ENV, "heads")
    if mode not in MLA_CACHES:
        raise ConfigError(f"{MLA_CACHE_ENV}={mode!r}: expected one of {', '.join(MLA_CACHES)}")
    return mode


def latent_size(config) -> int:
    """Values per token a latent MLA layer caches: ``kv_lora_rank + qk_rope_head_dim`` (upcycle kv-report's count)."""
    a = config.mixer_args("mla")
    return a.kv_lora_rank + a.qk_rope_head_dim


@dataclass(frozen=True)
class Mamba2Widths:
    """A Mamba2 layer's widths in the export and in vLLM's layout."""
    d_inner: int
    heads: int
    d_xb: int          # x channels in the export (d_inner in vLLM)
    d_b: int           # B channels in the export (n_groups * d_state in vLLM)
    d_c: int           # C channels (n_groups * d_state in both)
    repeat: int        # how many times each x head and each B group is repeated

    @property
    def conv_dim(self) -> int:
        """vLLM's conv channels: x, B and C at full width."""
        return self.d_inner + 2 * self.d_c


def _mamba2_widths(a, where: str = "") -> Mamba2Widths:
    d_xb = a.d_xb or a.d_inner
    repeat = a.d_inner // d_xb
    d_b = a.n_groups * a.d_state // repeat
    if d_b % a.d_state or a.n_groups % (d_b // a.d_state):
        # our layer shares each B group among consecutive heads; vLLM's layout needs whole groups to repeat
        raise ConfigError(f"{where}mamba2.d_xb: {a.d_xb} leaves B {d_b} channels wide, not whole d_state "
                          f"({a.d_state}) groups dividing n_groups ({a.n_groups})")
    return Mamba2Widths(a.d_inner, a.d_inner // a.head_dim, d_xb, d_b, a.n_groups * a.d_state, repeat)


def mamba2_widths(config) -> Mamba2Widths:
    return _mamba2_widths(config.mixer_args("mamba2"), _where(config))


def _repeat_rows(t: torch.Tensor, block: int, times: int) -> torch.Tensor:
    """Rows in blocks of ``block``, each block repeated ``times`` times in place:
    [n*block, ...] -> [n*times*block, ...]."""
    if times == 1:
        return t
    n = t.shape[0] // block
    return t.reshape(n, block, *t.shape[1:]).repeat_interleave(times, dim=0).reshape(n * times * block, *t.shape[1:])


def expand_mamba2_channels(t: torch.Tensor, config, offset: int) -> torch.Tensor:
    """``t``'s rows ``[offset:]`` hold [x | B | C] as the export has them (in_proj's rows after z, or the conv's
    channels): x repeated per head and B per group, as vLLM's Mamba2 (and ours without d_xb) lays them out."""
    w, a = mamba2_widths(config), config.mixer_args("mamba2")
    head, x, b, rest = t[:offset], *t[offset:].split([w.d_xb, w.d_b, t.shape[0] - offset - w.d_xb - w.d_b])
    return torch.cat([head, _repeat_rows(x, a.head_dim, w.repeat), _repeat_rows(b, a.d_state, w.repeat), rest])


def expanded_mamba2_config_values(config) -> dict:
    """``mamba2`` settings of the same layer without ``d_xb``: what :func:`expand_mamba2_channels` turns it into
    (tests build our own layer from them to check the mapping)."""
    a = config.mixer_args("mamba2")
    return {"d_state": a.d_state, "head_dim": a.head_dim, "n_groups": a.n_groups, "d_inner": a.d_inner,
            "conv_size": a.conv_size, "conv_bias": a.conv_bias, "norm_eps": a.norm_eps, "gate_bias": a.gate_bias}


class _Pending:
    """Weights held until their partner arrives (the MLP's gate and up become one matrix in vLLM)."""

    def __init__(self):
        self.held: Dict[str, torch.Tensor] = {}

    def pair(self, key: str, part: int, tensor: torch.Tensor) -> Optional[List[torch.Tensor]]:
        other = f"{key}#{1 - part}"
        if other not in self.held:
            self.held[f"{key}#{part}"] = tensor
            return None
        first = self.held.pop(other)
        return [tensor, first] if part == 0 else [first, tensor]


def mamba2_weights(name: str, tensor: torch.Tensor, config) -> List[Tuple[str, torch.Tensor]]:
    """One Mamba2 weight as vLLM's MambaMixer2 names and lays it out (``name`` after ``mixer.``): the ``mamba2``
    entry's ``serve_weights``."""
    a = config.mixer_args("mamba2")
    if name == "in_proj.weight":
        out = [(name, expand_mamba2_channels(tensor, config, a.d_inner))]
        if a.gate_bias:  # vLLM's use_bias puts a bias on out_proj too: a zero one keeps the function
            out.append(("out_proj.bias", torch.zeros(tensor.shape[1], dtype=tensor.dtype)))
        return out
    if name == "z_bias":  # vLLM's in_proj bias covers [z | x | B | C | dt]: only z has one in the export
        w = mamba2_widths(config)
        return [("in_proj.bias", torch.cat([tensor, tensor.new_zeros(w.conv_dim + w.heads)]))]
    if name in ("conv1d.weight", "conv1d.bias"):
        expanded = expand_mamba2_channels(tensor, config, 0)
        return [(name, expanded.unsqueeze(1) if name.endswith("weight") else expanded)]
    if name == "A_log":  # vLLM's loader of A stores -exp(A_log)
        return [("A", tensor)]
    if name == "norm_weight":
        return [("norm.weight", tensor)]
    return [(name, tensor)]


def served_weights(config, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The export's ``(name, tensor)`` pairs as the served model's parameters name and lay them out.

    Unchanged: embeddings, norms, MLA's projections and norms, lm_head (dropped when tied to the embeddings).
    Mamba2: x / B rows and conv channels repeated to vLLM's layout, ``A_log`` -> ``A``, ``norm_weight`` ->
    ``norm.weight``, a gate bias as in_proj's bias (each mixer's entry's ``serve_weights``). MLP: ``gate_proj`` and
    ``up_proj`` stacked as ``gate_up_proj``."""
    pending = _Pending()
    mappings = {}  # kind -> its serve_weights function, or None
    for name, tensor in weights:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        layer, rest = int(match.group(1)), match.group(2)
        prefix = f"model.layers.{layer}.mixer."
        kind = config.layer_plan[layer]
        if kind != MLP_KIND and kind not in mappings:
            path = mixer_spec(kind).serve_weights
            mappings[kind] = None if path is None else load_object(path)
        if mappings.get(kind) is not None:
            for new, t in mappings[kind](rest, tensor, config):
                yield prefix + new, t
        elif kind == MLP_KIND and rest in ("gate_proj.weight", "up_proj.weight"):
            both = pending.pair(prefix, 0 if rest.startswith("gate") else 1, tensor)
            if both is not None:
                yield prefix + "gate_up_proj.weight", torch.cat(both)
        else:
            yield name, tensor
    if pending.held:
        raise ConfigError(f"{_where(config)}weights: {', '.join(sorted(k.split('#')[0] for k in pending.held))} "
                          f"has gate_proj or up_proj without the other")


__all__ = ["served_kinds", "ATTENTION_HEAD_SIZES", "check_servable", "attention_head_size", "mamba2_widths",
           "expand_mamba2_channels", "mamba2_weights", "served_weights"]
