"""The generation cache of a hybrid stack, one entry per sublayer of the pattern.

* MLA (``*``): per token only the compressed KV latent (``kv_lora_rank`` values, after ``kv_a_norm``) and the
  rotated decoupled RoPE key (``qk_rope_head_dim`` values, one head shared by all heads). Decoding attends
  against the latent directly (W_UK absorbed into the query, W_UV into the output), so nothing per head is
  ever cached: ``kv_lora_rank + qk_rope_head_dim`` values per token per MLA layer, as ``hybridlm/kv_report.py`` counts.
* GDN / KDA / Mamba2: the recurrent state ``[B, H, K, V]`` (fp32) and the last ``conv_size`` inputs of each
  short convolution -- a constant size, whatever the sequence length.
* MLP (``-``): nothing.

Which entry a sublayer gets is its mixer's ``cache`` in the registry (:mod:`hybridlm.model.registry`):
``"latent"`` a :class:`LatentCacheLayer`, ``"recurrent"`` a :class:`RecurrentCacheLayer`, None a plain
:class:`CacheLayer` holding nothing.

:class:`HybridCache` is a transformers :class:`~transformers.cache_utils.Cache`, so ``model.generate`` carries
it between steps. :class:`InferenceContext` is what the sublayers see of one cached / padded forward.

**Static mode** (``HybridCache(config, max_length=N, batch_size=B, dtype=..., device=...)`` or
:meth:`HybridCache.static`): every tensor is allocated up front and then only written in place, so a decode
step keeps fixed tensor addresses and shapes and can be captured in a CUDA graph
(:class:`hybridlm.model.graphs.GraphedDecoder`). MLA layers hold ``kv [B, N, r_kv + rope]``; the new tokens'
entries are written with ``index_copy_`` at the slots given by a device-side length counter
(``cache.length``, advanced on the device in each forward); inside a captured step (:data:`FIXED_SHAPES`)
attention runs over the whole buffer with a mask built on the device from those positions (slots not yet written
are masked out), in an eager step over the slots written so far. Recurrent and conv
states are updated with ``copy_``. A prompt of any length <= N is prefilled, then single tokens (or small
blocks) follow, up to exactly N tokens in all; going past N raises ``ValueError``. Not supported in static
mode: padding (an ``attention_mask`` with zeros raises ``NotImplementedError``; every row must be a full
prompt), explicit ``position_ids``, ``crop`` and batch reshaping (beam expansion); ``reorder_cache`` works
in place. ``memory_bytes()`` counts what is *allocated* (the whole ``N`` positions), ``memory_bytes(used=True)``
only the positions written so far (for a dynamic cache both are the same).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
from transformers.cache_utils import Cache

from hybridlm.model.layers import build_sublayer
from hybridlm.model.layers.rope import rope_cos_sin
from hybridlm.model.registry import LATENT, RECURRENT, cache_of
from hybridlm.ops.backend import ScopedFlag

# A forward on a static cache inside ``with FIXED_SHAPES.on():`` keeps every shape fixed: MLA attends over the whole
# buffer under a mask built on the device (what a CUDA graph of a decode step needs; hybridlm/model/graphs.py turns
# it on for a step's warm-up and capture). Outside it, a forward on a static cache attends over the tokens cached so
# far (the host count), with the dynamic cache's mask: the same operations as transformers' loop on the dynamic
# cache, so the same results in every dtype (a softmax and a matmul over a longer, masked key range sum in another
# order: last-bit differences, which seeded sampling in half precision turns into other tokens).
FIXED_SHAPES = ScopedFlag("static_cache_fixed_shapes")


def _kept_length(length: int, crop_arg: int) -> int:
    """Length left by transformers' ``crop``: a negative argument removes that many tokens (transformers 5.2x),
    a positive one is the length to keep (older versions), 0 keeps everything."""
    return length + crop_arg if crop_arg < 0 else min(crop_arg, length) if crop_arg > 0 else length


def _check_shape(buffer: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """A static buffer takes only a value of its own shape (``copy_`` would silently broadcast a smaller batch)."""
    if value.shape != buffer.shape:
        raise ValueError(f"static HybridCache: {what} is {tuple(buffer.shape)}, got {tuple(value.shape)} "
                         "(batch size fixed at construction)")


class CacheLayer:
    """One sublayer's entry; this base holds nothing (MLP sublayers). Every cached tensor has the batch first,
    so the batch bookkeeping transformers asks for (beam reordering, expansion) is shared here."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False
    is_sliding = False
    static = False  # preallocated buffers, updated in place (HybridCache static mode)

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {}

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name, t in self.tensors().items():
            self._set(name, fn(t))

    def _set(self, name: str, value: torch.Tensor) -> None:
        setattr(self, name, value)

    def memory_bytes(self, used: bool = False) -> int:
        """Bytes held (``used``: only what the tokens seen so far fill; the same except for static MLA layers)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse_if_static("batch_select_indices")
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse_if_static("batch_repeat_interleave")
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def _refuse_if_static(self, what: str) -> None:
        if self.static:
            raise NotImplementedError(f"{what}: a static HybridCache has a fixed batch size")

    def static_tensors(self) -> Dict[str, torch.Tensor]:
        """The preallocated buffers of a static layer (what a CUDA graph reads and writes)."""
        return self.tensors() if self.static else {}

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

    def static_tensors(self):
        return {"kv": self.kv} if self.static else {}

    def _map(self, fn):
        if self.kv is not None:
            if self.static:
                self.kv.copy_(fn(self.kv))
            else:
                self.kv = fn(self.kv)

    def allocate(self, batch: int, max_length: int, kv_lora_rank: int, rope: int, dtype, device) -> None:
        """Static mode: a zeroed ``kv [batch, max_length, kv_lora_rank + rope]`` written in place from now on."""
        self.static, self.kv_lora_rank, self.seen_tokens = True, kv_lora_rank, 0
        self.kv = torch.zeros(batch, max_length, kv_lora_rank + rope, dtype=dtype, device=device)

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append the new tokens' entries; returns the whole cached ``kv = [latent | k_rope]`` ``[B, S, r + rope]``.

        Static mode: the entries are written in place at ``slots [T]`` (a device tensor of positions) and the
        whole buffer ``[B, max_length, r + rope]`` is returned (unwritten slots must be masked by the caller)."""
        new = torch.cat([latent, k_rope], dim=-1)
        if self.static:
            if new.shape[0] != self.kv.shape[0]:
                raise ValueError(f"static HybridCache holds a batch of {self.kv.shape[0]}, got {new.shape[0]}")
            self.kv.index_copy_(1, slots, new.to(self.kv.dtype))
            return self.kv
        self.kv_lora_rank = latent.shape[-1]
        self.kv = new if self.kv is None else torch.cat([self.kv, new], dim=1)
        return self.kv

    def get_seq_length(self) -> int:
        if self.static:
            return self.seen_tokens
        return 0 if self.kv is None else self.kv.shape[1]

    def memory_bytes(self, used: bool = False) -> int:
        if self.kv is None:
            return 0
        if self.static and used:
            return self.kv.shape[0] * self.seen_tokens * self.bytes_per_token()
        return self.kv.numel() * self.kv.element_size()

    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence occupies: (kv_lora_rank + qk_rope_head_dim) * dtype size."""
        return 0 if self.kv is None else self.kv.shape[-1] * self.kv.element_size()

    def crop(self, tokens_to_remove: int) -> None:
        if self.static:
            raise NotImplementedError("crop: not supported by a static HybridCache")
        self._map(lambda t: t[:, :_kept_length(self.get_seq_length(), tokens_to_remove)])

    def reset(self) -> None:
        if self.static:
            self.kv.zero_()
            self.seen_tokens = 0
        else:
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
        """Store ``state`` or ``conv:<name>``: copied into its buffer in static mode, else replaced."""
        if self.static:
            buffer = self.tensors()[name]
            _check_shape(buffer, value, "recurrent state" if name == "state" else f"conv state {name[5:]!r}")
            buffer.copy_(value)
        elif name.startswith("conv:"):
            self.conv_states[name[5:]] = value
        else:
            self.state = value

    def allocate(self, batch: int, state_shape, conv_shapes: Dict[str, tuple], dtype, device) -> None:
        """Static mode: zeroed ``state [batch, *state_shape]`` (fp32) and conv states ``[batch, D, W]`` (``dtype``),
        which equal "nothing seen yet" and are overwritten in place from now on."""
        self.static, self.seen_tokens = True, 0
        self.state = torch.zeros(batch, *state_shape, dtype=torch.float32, device=device)
        self.conv_states = {k: torch.zeros(batch, *shape, dtype=dtype, device=device)
                            for k, shape in conv_shapes.items()}

    def set_conv(self, name: str, value: torch.Tensor) -> None:
        """The conv state ``name`` after the tokens just run (copied into its buffer in static mode)."""
        self._set(f"conv:{name}", value)

    def advance(self, state: torch.Tensor, n_tokens: int) -> None:
        """Record the recurrent state after ``n_tokens`` more tokens (the conv states are set as they run).
        Static mode: copied into the state buffer; the token count is kept by the :class:`HybridCache`."""
        self._set("state", state)
        if not self.static:
            self.seen_tokens += n_tokens

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def crop(self, tokens_to_remove: int) -> None:
        if _kept_length(self.seen_tokens, tokens_to_remove) < self.seen_tokens:
            raise NotImplementedError("a recurrent state cannot drop tokens (assisted decoding is not supported)")

    def reset(self) -> None:
        if self.static:
            for t in self.tensors().values():
                t.zero_()
            self.seen_tokens = 0
        else:
            self.state, self.conv_states, self.seen_tokens = None, {}, 0


def static_shapes(config, kind: str) -> Optional[dict]:
    """Per-sequence shapes a static cache preallocates for a sublayer ``kind`` (None: nothing cached), as the
    sublayer itself reports them (``cache_shapes``), built on the meta device: no memory, no duplicated
    arithmetic. MLA: ``kv_lora_rank`` + ``rope`` per position; mixers: ``state`` and named ``conv`` shapes."""
    if cache_of(kind) is None:
        return None

    with torch.device("meta"):
        return build_sublayer(config, kind).cache_shapes()


class HybridCache(Cache):
    """Per-sublayer cache of a :class:`~hybridlm.model.HybridForCausalLM`; built from its config.

    ``HybridForCausalLM.forward(..., use_cache=True)`` creates one when none is passed and returns it as
    ``output.cache``; ``generate`` does this by itself.

    ``max_length`` (with ``batch_size``, and the model's ``dtype`` / ``device``) makes it a *static* cache:
    everything is preallocated and updated in place (see the module docstring); pass it to the forward as
    ``cache=``. Without ``max_length`` it is the dynamic cache, grown by concatenation.
    """

    def __init__(self, config, max_length: Optional[int] = None, batch_size: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device=None):
        entry = {LATENT: LatentCacheLayer, RECURRENT: RecurrentCacheLayer, None: CacheLayer}
        layers = [entry[cache_of(kind)]() for kind in config.layer_plan]
        super().__init__(layers=layers)
        self.max_length = max_length
        self.length: Optional[torch.Tensor] = None  # static: tokens cached, on the device ([1], long)
        if max_length is None:
            if batch_size is not None:
                raise ValueError("HybridCache: batch_size only applies to a static cache (give max_length too)")
            return
        if batch_size is None or batch_size < 1 or max_length < 1:
            raise ValueError(f"a static HybridCache needs max_length >= 1 and batch_size >= 1, got "
                             f"max_length={max_length}, batch_size={batch_size}")
        dtype = dtype or torch.get_default_dtype()
        device = torch.device("cpu" if device is None else device)
        self.static_batch_size, self.static_dtype = batch_size, dtype
        shapes_of = {kind: static_shapes(config, kind) for kind in set(config.layer_plan)}  # one probe per kind
        for layer, kind in zip(self.layers, config.layer_plan):
            shapes = shapes_of[kind]
            if isinstance(layer, LatentCacheLayer):
                layer.allocate(batch_size, max_length, shapes["kv_lora_rank"], shapes["rope"], dtype, device)
            elif isinstance(layer, RecurrentCacheLayer):
                layer.allocate(batch_size, shapes["state"], shapes["conv"], dtype, device)
        self.length = torch.zeros(1, dtype=torch.long, device=device)
        self.key_positions = torch.arange(max_length, device=device)  # slot index of every cached position
        self._seen = 0  # host-side mirror of ``length`` (never read back from the device)

    @classmethod
    def static(cls, config, max_length: int, batch_size: int, dtype: Optional[torch.dtype] = None,
               device=None) -> "HybridCache":
        """A static (preallocated, in-place) cache; the same as ``HybridCache(config, max_length=..., ...)``."""
        return cls(config, max_length=max_length, batch_size=batch_size, dtype=dtype, device=device)

    @property
    def is_static(self) -> bool:
        return self.max_length is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (every sequence of the batch, padding included): any caching layer knows it."""
        if self.is_static:
            return self._seen
        for layer in self.layers[layer_idx:] + self.layers[:layer_idx]:
            if isinstance(layer, (LatentCacheLayer, RecurrentCacheLayer)):
                return layer.get_seq_length()
        return 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_length if self.is_static else -1

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        if self.is_static:
            raise NotImplementedError("crop: not supported by a static HybridCache")
        for layer in self.layers:  # refuse before any MLA layer is cut, so the layers never disagree
            if isinstance(layer, RecurrentCacheLayer):
                layer.crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        """Empty the cache (static mode: zero the buffers in place, so a captured graph stays valid)."""
        super().reset()
        if self.is_static:
            self.length.zero_()
            self._seen = 0

    # -- static mode bookkeeping ---------------------------------------------------------------
    def begin_static_forward(self, seq_len: int, device) -> torch.Tensor:
        """Reserve the next ``seq_len`` slots: returns their positions ``[seq_len]`` (on the device, from
        :attr:`length`) and advances :attr:`length` on the device and the host count, without any sync."""
        if self._seen + seq_len > self.max_length:
            raise ValueError(f"static HybridCache full: {self._seen} tokens cached + {seq_len} new > "
                             f"max_length {self.max_length}")
        slots = self.length + torch.arange(seq_len, device=device)
        self.length.add_(seq_len)
        self.note_tokens(seq_len)
        return slots

    def grown(self, config, max_length: int) -> "HybridCache":
        """A static cache of ``max_length`` positions (at least this one's) holding what this one holds: its
        token count, the latents written so far, the recurrent and conv states. What a generation that fills this
        cache continues in."""
        if not self.is_static or max_length < self.max_length:
            raise ValueError(f"grown: a static cache of max_length >= {self.max_length}, got {max_length}")
        new = HybridCache(config, max_length=max_length, batch_size=self.static_batch_size, dtype=self.static_dtype,
                          device=self.length.device)
        seen, target = self._seen, new.static_tensors()
        for name, t in self.static_tensors().items():
            if name.endswith(":kv"):
                target[name][:, :seen].copy_(t[:, :seen])
            else:
                target[name].copy_(t)
        new.note_tokens(seen)
        return new

    def note_tokens(self, n: int) -> None:
        """Host-side count of ``n`` more cached tokens (a graph replay advances only the device counter)."""
        self._seen += n
        for layer in self.layers:
            if isinstance(layer, (LatentCacheLayer, RecurrentCacheLayer)):
                layer.seen_tokens += n

    def static_tensors(self) -> Dict[str, torch.Tensor]:
        """Every buffer of a static cache, ``length`` included (what a CUDA graph of a step reads and writes)."""
        out = {"length": self.length}
        for i, layer in enumerate(self.layers):
            out.update({f"{i}:{k}": t for k, t in layer.static_tensors().items()})
        return out

    def snapshot(self, include_latents: bool = False) -> tuple:
        """Copies of the static buffers and the host count, for :meth:`restore` (what a graph capture's warm-up
        steps change). The MLA buffers are left out unless ``include_latents``: a step writes them only at the
        slots from :attr:`length` on, which no later step reads before writing them again, so after a restore
        of the length counter they need no restoring (and a copy of them would double the cache's memory)."""
        return {k: t.clone() for k, t in self.static_tensors().items()
                if include_latents or not k.endswith(":kv")}, self._seen

    def restore(self, snap: tuple) -> None:
        tensors, seen = snap
        for k, t in self.static_tensors().items():
            if k in tensors:
                t.copy_(tensors[k])
        self.note_tokens(seen - self._seen)

    # -------------------------------------------------------------------------------------------
    def memory_bytes(self, kind: Optional[str] = None, used: bool = False) -> int:
        """Bytes held, all layers or only ``kind`` ``"mla"`` (latents) / ``"recurrent"`` (states and conv states).

        A static cache holds its whole ``max_length`` from the start: ``memory_bytes()`` is what is allocated,
        ``memory_bytes(used=True)`` counts the MLA positions written so far only (recurrent states count whole
        either way). For a dynamic cache the two are equal."""
        types = {"mla": LatentCacheLayer, "recurrent": RecurrentCacheLayer, None: CacheLayer}[kind]
        return sum(layer.memory_bytes(used=used) for layer in self.layers if isinstance(layer, types))

    def mla_bytes_per_token(self) -> int:
        """Bytes one more token adds to the cache of one sequence (only MLA layers grow with the length)."""
        return sum(layer.bytes_per_token() for layer in self.layers if isinstance(layer, LatentCacheLayer))


@dataclass
class InferenceContext:
    """What the sublayers of one cached or padded forward need beyond their input.

    ``key_mask [B, past + T]`` is False at padding (None: no padding anywhere); ``positions`` are the RoPE
    positions of the new tokens, ``[B, T]`` or ``[1, T]``.

    ``static`` (a static :class:`HybridCache`): ``positions [1, T]`` are computed on the device from the
    cache's length counter and are also the cache slots the new tokens are written to; ``past_length`` is the
    host-side count (used only to pick a prompt's code path and, unless ``fixed_shapes``, to cut the attended
    keys to the tokens cached so far; never to index). ``fixed_shapes`` (:data:`FIXED_SHAPES` on): attention runs
    over the whole buffer under a device-built mask.
    """

    cache: Optional[HybridCache]
    key_mask: Optional[torch.Tensor]
    positions: torch.Tensor
    past_length: int
    static: bool = False
    fixed_shapes: bool = False
    _rope: Dict[tuple, tuple] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cache: Optional[HybridCache], attention_mask: Optional[torch.Tensor],
              position_ids: Optional[torch.Tensor], seq_len: int, device: torch.device) -> "InferenceContext":
        """Positions follow the attention mask (``cumsum - 1``, as transformers' generate computes them) so a
        left-padded sequence gets the positions it would have alone."""
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None and cache.is_static:
            return cls._build_static(cache, attention_mask, position_ids, seq_len, device)
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

    @classmethod
    def _build_static(cls, cache: HybridCache, attention_mask, position_ids, seq_len: int, device):
        """No host sync and nothing shaped by a device value: what a CUDA graph of a decode step needs."""
        past = cache.get_seq_length()
        if position_ids is not None:
            raise ValueError("a static HybridCache takes no position_ids: positions follow its length counter")
        if attention_mask is not None:  # accepted only without padding (checked on the host: not for graphs)
            if attention_mask.dim() != 2 or attention_mask.shape[1] != past + seq_len:
                raise ValueError(f"attention_mask: expected [batch, {past + seq_len}] (cached {past} + new "
                                 f"{seq_len} tokens), got {tuple(attention_mask.shape)}")
            if not bool(attention_mask.bool().all()):
                raise NotImplementedError("a static HybridCache does not support padding: pass full rows "
                                          "(or use the dynamic cache for left-padded batches)")
        slots = cache.begin_static_forward(seq_len, device)
        return cls(cache, None, slots.unsqueeze(0), past, static=True, fixed_shapes=FIXED_SHAPES.active())

    def layer(self, idx: int):
        return None if self.cache is None else self.cache.layers[idx]

    def rope_cos_sin(self, dim: int, theta: float, inv_freq: Optional[tuple] = None):
        """RoPE ``cos, sin`` tables of :attr:`positions`, computed once per forward and shared by every MLA
        layer of that shape (decoding would otherwise rebuild them in each layer at each step)."""
        key = (dim, float(theta), inv_freq)
        if key not in self._rope:
            self._rope[key] = rope_cos_sin(self.positions, dim, theta, inv_freq)
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
        if self.fixed_shapes:  # [1, 1, T, max_length]: slots up to each query's own position (later ones unwritten)
            return (self.cache.key_positions <= self.positions.unsqueeze(-1)).unsqueeze(-3)
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
