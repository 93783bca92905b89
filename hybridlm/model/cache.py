"""The generation cache of a hybrid stack, one entry per sublayer of the pattern.

* MLA (``*``): per token only the compressed KV latent (``kv_lora_rank`` values, after ``kv_a_norm``) and the
  rotated decoupled RoPE key (``qk_rope_head_dim`` values, one head shared by all heads). Decoding attends
  against the latent directly (W_UK absorbed into the query, W_UV into the output), so nothing per head is
  ever cached: ``r_kv + d_rope`` values per token per MLA layer, as ``upcycle/kv_report.py`` counts.
* GDN / KDA / Mamba2: the recurrent state ``[B, H, K, V]`` (fp32) and the last ``conv_size`` inputs of each
  short convolution -- a constant size, whatever the sequence length.
* MLP (``-``): nothing.

:class:`HybridCache` is a transformers :class:`~transformers.cache_utils.Cache`, so ``model.generate`` carries
it between steps. :class:`InferenceContext` is what the sublayers see of one cached / padded forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
from transformers.cache_utils import Cache

from hybridlm.model.pattern import MIXERS


def _kept_length(length: int, crop_arg: int) -> int:
    """Length left by transformers' ``crop``: a negative argument removes that many tokens (transformers 5.2x),
    a positive one is the length to keep (older versions), 0 keeps everything."""
    return length + crop_arg if crop_arg < 0 else min(crop_arg, length) if crop_arg > 0 else length


class CacheLayer:
    """One sublayer's entry; this base holds nothing (MLP sublayers). Every cached tensor has the batch first,
    so the batch bookkeeping transformers asks for (beam reordering, expansion) is shared here."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False
    is_sliding = False

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {}

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name, t in self.tensors().items():
            self._set(name, fn(t))

    def _set(self, name: str, value: torch.Tensor) -> None:
        setattr(self, name, value)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self) -> None:  # states are small or needed every step: never offloaded
        pass

    def prefetch(self) -> None:
        pass

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def reset(self) -> None:
        pass


class LatentCacheLayer(CacheLayer):
    """An MLA layer's cache: ``latent [B, S, kv_lora_rank]`` and ``k_rope [B, S, qk_rope_head_dim]``, held as
    one joint tensor ``kv [B, S, kv_lora_rank + qk_rope_head_dim]`` (``latent`` and ``k_rope`` are views of it):
    the absorbed decode attends with ``kv`` itself as the key, so no per-step concatenation is needed."""

    def __init__(self):
        self.kv: Optional[torch.Tensor] = None
        self.kv_lora_rank = 0

    @property
    def latent(self) -> Optional[torch.Tensor]:
        return None if self.kv is None else self.kv[..., :self.kv_lora_rank]

    @property
    def k_rope(self) -> Optional[torch.Tensor]:
        return None if self.kv is None else self.kv[..., self.kv_lora_rank:]

    def tensors(self):
        return {} if self.kv is None else {"latent": self.latent, "k_rope": self.k_rope}

    def _map(self, fn):
        if self.kv is not None:
            self.kv = fn(self.kv)

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' entries; returns the whole cached ``kv = [latent | k_rope]`` ``[B, S, r + rope]``."""
        new = torch.cat([latent, k_rope], dim=-1)
        self.kv_lora_rank = latent.shape[-1]
        self.kv = new if self.kv is None else torch.cat([self.kv, new], dim=1)
        return self.kv

    def get_seq_length(self) -> int:
        return 0 if self.kv is None else self.kv.shape[1]

    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence occupies: (kv_lora_rank + qk_rope_head_dim) * dtype size."""
        return 0 if self.kv is None else self.kv.shape[-1] * self.kv.element_size()

    def crop(self, tokens_to_remove: int) -> None:
        self._map(lambda t: t[:, :_kept_length(self.get_seq_length(), tokens_to_remove)])

    def reset(self) -> None:
        self.kv = None


class RecurrentCacheLayer(CacheLayer):
    """A GDN / KDA / Mamba2 layer's cache: ``state [B, H, K, V]`` and named conv states ``[B, D, conv_size]``."""

    is_croppable = False  # a recurrence cannot be rolled back

    def __init__(self):
        self.state: Optional[torch.Tensor] = None
        self.conv_states: Dict[str, torch.Tensor] = {}
        self.seen_tokens = 0

    def tensors(self):
        out = {f"conv:{k}": v for k, v in self.conv_states.items()}
        if self.state is not None:
            out["state"] = self.state
        return out

    def _set(self, name, value):
        if name.startswith("conv:"):
            self.conv_states[name[5:]] = value
        else:
            self.state = value

    def advance(self, state: torch.Tensor, n_tokens: int) -> None:
        """Record the recurrent state after ``n_tokens`` more tokens (the conv states are set as they run)."""
        self.state, self.seen_tokens = state, self.seen_tokens + n_tokens

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def crop(self, tokens_to_remove: int) -> None:
        if _kept_length(self.seen_tokens, tokens_to_remove) < self.seen_tokens:
            raise NotImplementedError("a recurrent state cannot drop tokens (assisted decoding is not supported)")

    def reset(self) -> None:
        self.state, self.conv_states, self.seen_tokens = None, {}, 0


class HybridCache(Cache):
    """Per-sublayer cache of a :class:`~hybridlm.model.HybridForCausalLM`; built from its config.

    ``HybridForCausalLM.forward(..., use_cache=True)`` creates one when none is passed and returns it as
    ``output.cache``; ``generate`` does this by itself.
    """

    def __init__(self, config):
        layers = [LatentCacheLayer() if kind == "mla" else RecurrentCacheLayer() if kind in MIXERS else CacheLayer()
                  for kind in config.layer_plan]
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (every sequence of the batch, padding included): any caching layer knows it."""
        for layer in self.layers[layer_idx:] + self.layers[:layer_idx]:
            if isinstance(layer, (LatentCacheLayer, RecurrentCacheLayer)):
                return layer.get_seq_length()
        return 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:  # refuse before any MLA layer is cut, so the layers never disagree
            if isinstance(layer, RecurrentCacheLayer):
                layer.crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def memory_bytes(self, kind: Optional[str] = None) -> int:
        """Bytes held, all layers or only ``kind`` ``"mla"`` (latents) / ``"recurrent"`` (states and conv states)."""
        types = {"mla": LatentCacheLayer, "recurrent": RecurrentCacheLayer, None: CacheLayer}[kind]
        return sum(layer.memory_bytes() for layer in self.layers if isinstance(layer, types))

    def mla_bytes_per_token(self) -> int:
        """Bytes one more token adds to the cache of one sequence (only MLA layers grow with the length)."""
        return sum(layer.bytes_per_token() for layer in self.layers if isinstance(layer, LatentCacheLayer))


@dataclass
class InferenceContext:
    """What the sublayers of one cached or padded forward need beyond their input.

    ``key_mask [B, past + T]`` is False at padding (None: no padding anywhere); ``positions`` are the RoPE
    positions of the new tokens, ``[B, T]`` or ``[1, T]``.
    """

    cache: Optional[HybridCache]
    key_mask: Optional[torch.Tensor]
    positions: torch.Tensor
    past_length: int
    _rope: Dict[tuple, tuple] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cache: Optional[HybridCache], attention_mask: Optional[torch.Tensor],
              position_ids: Optional[torch.Tensor], seq_len: int, device: torch.device) -> "InferenceContext":
        """Positions follow the attention mask (``cumsum - 1``, as transformers' generate computes them) so a
        left-padded sequence gets the positions it would have alone."""
        past = cache.get_seq_length() if cache is not None else 0
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[1] != past + seq_len:
                raise ValueError(f"attention_mask: expected [batch, {past + seq_len}] (cached {past} + new {seq_len} "
                                 f"tokens), got {tuple(attention_mask.shape)}")
            key_mask = attention_mask.to(device=device, dtype=torch.bool)
            if bool(key_mask.all()):  # no padding: the unmasked paths apply
                key_mask = None
        if position_ids is None:
            if key_mask is not None:
                position_ids = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_len:]
            else:
                position_ids = torch.arange(past, past + seq_len, device=device).unsqueeze(0)
        return cls(cache, key_mask, position_ids.to(device), past)

    def layer(self, idx: int):
        return None if self.cache is None else self.cache.layers[idx]

    def rope_cos_sin(self, dim: int, theta: float):
        """RoPE ``cos, sin`` tables of :attr:`positions`, computed once per forward and shared by every MLA
        layer of that shape (decoding would otherwise rebuild them in each layer at each step)."""
        key = (dim, float(theta))
        if key not in self._rope:
            from hybridlm.model.layers.rope import rope_cos_sin
            self._rope[key] = rope_cos_sin(self.positions, dim, theta)
        return self._rope[key]

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, ...]`` with padded positions set to 0 (``where``, not a product: padding may hold inf/nan)."""
        if self.key_mask is None:
            return x
        keep = self.key_mask[:, -x.shape[1]:]
        return x.masked_fill(~keep.view(*keep.shape, *([1] * (x.dim() - 2))), 0)

    def attention_mask(self, seq_len: int) -> Optional[torch.Tensor]:
        """Boolean ``[B|1, 1, T, past + T]`` mask (True: may attend), or None where plain attention applies
        (causal over the new tokens when nothing is cached, everything cached when decoding one token)."""
        past = self.past_length
        if self.key_mask is None and (seq_len == 1 or past == 0):
            return None
        device = self.positions.device
        q_pos = torch.arange(past, past + seq_len, device=device).unsqueeze(-1)
        k_pos = torch.arange(past + seq_len, device=device)
        allowed = k_pos <= q_pos  # [T, S]
        if self.key_mask is not None:
            # a padded query still sees itself, so no row is fully masked (softmax of all -inf is nan)
            allowed = (allowed & self.key_mask.unsqueeze(1)) | (k_pos == q_pos)
        return allowed.unsqueeze(-3)
