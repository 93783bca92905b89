"""Multi-head latent attention (DeepSeek-V2 style) through ``scaled_dot_product_attention``.

q  = q_b(norm(q_a(x)))                  -> per head [q_nope | q_rope]
kv = kv_a(x) = [c_kv (kv_lora_rank) | k_rope (shared by all heads)]
k_nope, v = kv_b(norm(c_kv))             -> per head
RoPE only on the rope dims; softmax scale (qk_nope + qk_rope)^-1/2.
A KV cache needs only c_kv and k_rope per token: kv_lora_rank + qk_rope_head_dim values.
``latent_norm: false`` drops the two latent RMSNorms (exact SVD upcycling needs a linear path).

Generation (an :class:`~hybridlm.model.cache.InferenceContext`): the prompt runs the expanded form above and
stores ``norm(c_kv)`` and the rotated ``k_rope`` in the cache; later tokens attend to the cache directly in
the latent space, with kv_b's key rows absorbed into the query and its value rows into the output:
``q_nope . (W_UK c) = (W_UK^T q_nope) . c`` and ``sum_s p_s W_UV c_s = W_UV sum_s p_s c_s``.
Padded keys are masked out and RoPE positions come per sequence from the attention mask.
With a static cache (fixed-size buffer for CUDA graphs) the new entries are written in place at device-side
slots; a captured step (``cache.FIXED_SHAPES``) runs the absorbed attention over the whole buffer, unwritten slots
masked, an eager step over the slots written so far, as the dynamic cache does (a prompt into an empty static
cache takes the expanded form over its own tokens). With ``runtime.mla_split_k_decode`` the absorbed
attention of a decode step runs :func:`hybridlm.ops.latent_decode.latent_attention_decode` on CUDA instead of
SDPA: the cache split along its length over the whole GPU (SDPA walks it with one thread block at batch 1).

This file is the whole mixer: its settings (:class:`MLAArgs`, the ``mla`` section of a config), the module, its
costs and its registry entry; the entry names its vLLM twin (``hybridlm/serve``). Its upcycling from attention
(SVD, ``upcycle/init_mla.py``) is the route's attention student, not a linear mixer's ``from_attention``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridlm.model.layers.norm import RMSNorm
from hybridlm.model.layers.mixing_flops import causal_attention_flops
from hybridlm.model.layers.rope import apply_rope, rope_cos_sin
from hybridlm.config.errors import ConfigError
from hybridlm.model.registry import LATENT, MixerCosts, check_divides, check_positive, register_mixer
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.ops.backend import use_triton
from hybridlm.ops.latent_decode import MAX_ROWS, latent_attention_decode

# Attention over the cache leaves cuDNN's SDPA out: torch picks it first on Hopper, and it builds an execution
# plan for every new key length, i.e. at every decoding step: host work that makes the eager decode step of the
# upcycled SmolLM2 hybrid several times slower (BENCHMARKS.md, "Generation throughput"). Flash / memory-efficient
# need none.
_CACHE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class MLAArgs:
    num_heads: int = 16
    q_lora_rank: Optional[int] = 672   # 0 / null: a full-rank q projection
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: Optional[int] = None  # default hidden_size / num_heads
    rope_theta: float = 500000.0
    # per-pair inverse frequencies (qk_rope_head_dim / 2 floats; pair i rotates by position * rope_inv_freq[i]);
    # set, they replace the rope_theta progression (an upcycled layer keeps a scaled teacher's frequencies)
    rope_inv_freq: Optional[List[float]] = None
    latent_norm: bool = True           # RMSNorm on the q / kv latents (off for exact SVD upcycling)
    norm_eps: float = 1e-6

    def finalize(self, hidden: int, where: str) -> None:
        if self.v_head_dim is None:
            check_divides(where, "num_heads", self.num_heads, "hidden_size", hidden)
            self.v_head_dim = hidden // self.num_heads
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim < 0:
            raise ConfigError(f"{where}.qk_rope_head_dim: {self.qk_rope_head_dim} must be even and >= 0 "
                              "(RoPE rotates pairs; 0 means no position encoding)")
        check_positive(self, where, ("num_heads", "kv_lora_rank", "v_head_dim"))
        if self.rope_inv_freq is not None:
            f = self.rope_inv_freq
            if (not isinstance(f, (list, tuple)) or len(f) != self.qk_rope_head_dim // 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
                               for v in f)):
                raise ConfigError(f"{where}.rope_inv_freq: expected {self.qk_rope_head_dim // 2} positive finite "
                                  f"numbers (one per rotation pair), got {f!r}")
            self.rope_inv_freq = [float(v) for v in f]


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, args: MLAArgs, hidden_size: int, layer_idx: int = 0, runtime: Optional[RuntimeSettings] = None):
        """``args``: finalized settings (``args.finalize(hidden_size, "mla")``); ``runtime``: the model's settings, read
        when it runs (None: the defaults)."""
        super().__init__()
        a, d = args, hidden_size
        runtime = RuntimeSettings() if runtime is None else runtime
        self.layer_idx = layer_idx
        self.runtime = runtime  # model.set_runtime replaces it
        self.num_heads = a.num_heads
        self.nope, self.rope, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = a.kv_lora_rank, a.q_lora_rank
        self.rope_theta = a.rope_theta
        self.rope_inv_freq = tuple(a.rope_inv_freq) if a.rope_inv_freq else None
        self.scale = (self.nope + self.rope) ** -0.5
        qk_head = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(self.q_lora_rank, a.norm_eps, runtime) if a.latent_norm else nn.Identity()
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_head, bias=False)
        else:
            self.q_proj = nn.Linear(d, self.num_heads * qk_head, bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, a.norm_eps, runtime) if a.latent_norm else nn.Identity()
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, d, bias=False)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        B, T, _ = x.shape
        if ctx is None:  # training: causal attention over the whole input
            q_nope, q_rope, latent, k_rope = self._project(x, torch.arange(T, device=x.device))
            o = self._attend_expanded(q_nope, q_rope, latent, k_rope, None)
        else:
            o = self._attend_cached(x, ctx)
        return self.o_proj(o.reshape(B, T, self.num_heads * self.v_dim))

    def _project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None):
        """Queries ``q_nope [B,T,H,nope]``, rotated ``q_rope [B,T,H,rope]``, and what a cache keeps per token:
        ``latent = norm(c_kv) [B,T,r_kv]`` and the rotated shared ``k_rope [B,T,rope]``. ``cos_sin``: the RoPE
        tables of ``positions`` when already computed (one inference forward shares them across layers)."""
        B, T, _ = x.shape
        if cos_sin is None:
            cos_sin = rope_cos_sin(positions, self.rope, self.rope_theta, self.rope_inv_freq)
        cos, sin = cos_sin
        q = self.project_q(x).view(B, T, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_rope = apply_rope(k_rope.view(B, T, 1, self.rope), cos, sin).squeeze(2)
        return q_nope, apply_rope(q_rope, cos, sin), self.kv_a_norm(c_kv), k_rope

    def _attend_expanded(self, q_nope, q_rope, latent, k_rope, mask):
        """Per-head keys and values decompressed from the latent by kv_b, then SDPA (causal when ``mask`` is None).
        Returns ``[B, T, H, v_dim]``."""
        B, S, H = latent.shape[0], latent.shape[1], self.num_heads
        kv = self.kv_b_proj(latent).view(B, S, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(B, S, H, self.rope)], dim=-1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)
        return o.transpose(1, 2)

    def cache_shapes(self) -> dict:
        """Per-position widths of this layer's generation cache: the latent and the shared RoPE key."""
        return {"kv_lora_rank": self.kv_lora_rank, "rope": self.rope}

    def _attend_absorbed(self, q_nope, q_rope, kv, mask):
        """Attention straight against the cached ``kv = [latent | k_rope]`` ``[B, S, r_kv + rope]`` (``mask``
        ``[B|1, 1, T, S]``, None: every key is visible). Returns ``[B, T, H, v_dim]``.

        The one key "head" is shared by all query heads, so the heads are folded into the query length
        (``[B, 1, H*T, r_kv + rope]`` against ``[B, 1, S, r_kv + rope]``): the latents are read once per layer,
        not once per head through an expanded view. ``kv`` itself also serves as the value (its rope columns
        are dropped from the output): q, k and v then share one head size, which lets SDPA pick its flash
        kernel on GPU, and nothing is sliced or copied per step."""
        B, T, H = q_nope.shape[0], q_nope.shape[1], self.num_heads
        r = self.kv_lora_rank
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, r)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q = torch.cat([torch.einsum("bthn,hnr->bhtr", q_nope, w_uk), q_rope.transpose(1, 2)], dim=-1)
        if self._use_split_k(q, kv):
            o = latent_attention_decode(q.reshape(B, H * T, q.shape[-1]), kv, None if mask is None else mask[:, 0],
                                        self.scale, r, T)
            return torch.einsum("bhtr,hvr->bthv", o.view(B, H, T, r), w_uv)
        q = q.reshape(B, 1, H * T, q.shape[-1])
        if mask is not None:  # [B|1, 1, T, S] -> the same rows for every head: [B|1, 1, H*T, S]
            mask = mask.reshape(-1, 1, T, mask.shape[-1])
            mask = mask.unsqueeze(2).expand(mask.shape[0], 1, H, T, mask.shape[-1]).reshape(mask.shape[0], 1, H * T, -1)
        k = kv.unsqueeze(1)
        with sdpa_kernel(_CACHE_SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(q, k, k, attn_mask=mask, scale=self.scale)  # [B, 1, H*T, r + rope]
        return torch.einsum("bhtr,hvr->bthv", o[..., :r].reshape(B, H, T, r), w_uv)

    def _use_split_k(self, q: torch.Tensor, kv: torch.Tensor) -> bool:
        """``runtime.mla_split_k_decode``, a few query rows (a decode step) outside autograd, on the Triton path, q
        and the cache of one dtype."""
        return (self.runtime.mla_split_k_decode and q.shape[1] * q.shape[2] <= MAX_ROWS
                and not torch.is_grad_enabled() and q.dtype == kv.dtype and use_triton(self.runtime.backend, kv))

    def _attend_cached(self, x, ctx):
        """A prompt (nothing cached yet) takes the expanded form; later tokens the absorbed one over the cache."""
        cos_sin = ctx.rope_cos_sin(self.rope, self.rope_theta, self.rope_inv_freq)
        q_nope, q_rope, latent, k_rope = self._project(x, ctx.positions, cos_sin)
        cache = ctx.layer(self.layer_idx)
        if ctx.static:  # written in place at the device-side slots
            kv = cache.update(latent, k_rope, ctx.positions[0])
            if ctx.past_length == 0 and x.shape[1] > 1:  # a prompt into an empty cache: only its own tokens
                return self._attend_expanded(q_nope, q_rope, latent, k_rope, None)
            if not ctx.fixed_shapes:  # eager: the tokens cached so far, as the dynamic cache attends them
                kv = kv[:, :ctx.past_length + x.shape[1]]
            # else (a CUDA graph's step): the whole buffer under a device-built mask
            return self._attend_absorbed(q_nope, q_rope, kv, ctx.attention_mask(x.shape[1]))
        mask = ctx.attention_mask(x.shape[1])
        if cache is None or ctx.past_length == 0:
            if cache is not None:
                cache.update(latent, k_rope)
            return self._attend_expanded(q_nope, q_rope, latent, k_rope, mask)
        return self._attend_absorbed(q_nope, q_rope, cache.update(latent, k_rope), mask)


# ------------------------------------------------------------------------------------- registry costs
def mla_flops(a, seq_len: int) -> float:
    """Causal attention over the decompressed heads: scores over nope + rope dims, values of v_head_dim."""
    return causal_attention_flops(a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim, seq_len)


def mla_cache_per_token(a) -> int:
    """The latent and the shared RoPE key."""
    return a.kv_lora_rank + a.qk_rope_head_dim


def mla_activations(a) -> float:
    """The q latent, q, the kv latent + rope key, the decompressed keys and values, the expanded keys, the
    attention output and SDPA's fp32 log-sum-exp."""
    qk, H = a.qk_nope_head_dim + a.qk_rope_head_dim, a.num_heads
    return ((a.q_lora_rank or 0) + H * qk + a.kv_lora_rank + a.qk_rope_head_dim + H * (a.qk_nope_head_dim + a.v_head_dim)
            + 2 * H * qk + H * a.v_head_dim + 2 * H)


MLA_COSTS = MixerCosts(flops=mla_flops, cache_per_token=mla_cache_per_token, activations=mla_activations)

MLA = register_mixer("mla", symbol="*", args=MLAArgs, module=MultiHeadLatentAttention, cache=LATENT, linear=False,
                     save_unused=True, costs=MLA_COSTS, title="MLA", serve_layer="hybridlm.serve.model:served_mla")
