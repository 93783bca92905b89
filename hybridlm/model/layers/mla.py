"""Multi-head latent attention (DeepSeek-V2 style) through ``scaled_dot_product_attention``.

q  = q_b(norm(q_a(x)))                  -> per head [q_nope | q_rope]
kv = kv_a(x) = [c_kv (kv_lora_rank) | k_rope (shared by all heads)]
k_nope, v = kv_b(norm(c_kv))             -> per head
RoPE only on the rope dims; softmax scale (qk_nope + qk_rope)^-1/2.
A KV cache needs only c_kv and k_rope per token: kv_lora_rank + qk_rope_head_dim values.
``latent_norm: false`` drops the two latent RMSNorms (exact SVD upcycling needs a linear path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.model.layers.norm import RMSNorm
from hybridlm.model.layers.rope import apply_rope, rope_cos_sin


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        a = config.mixer_args("mla")
        d = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = a.num_heads
        self.nope, self.rope, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = a.kv_lora_rank, a.q_lora_rank
        self.rope_theta = a.rope_theta
        self.scale = (self.nope + self.rope) ** -0.5
        qk_head = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(self.q_lora_rank, a.norm_eps, config.backend) if a.latent_norm else nn.Identity()
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_head, bias=False)
        else:
            self.q_proj = nn.Linear(d, self.num_heads * qk_head, bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, a.norm_eps, config.backend) if a.latent_norm else nn.Identity()
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, d, bias=False)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        positions = torch.arange(T, device=x.device) if positions is None else positions
        cos, sin = rope_cos_sin(positions, self.rope, self.rope_theta)
        q = self.project_q(x).view(B, T, H, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).view(B, T, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.view(B, T, 1, self.rope), cos, sin).expand(B, T, H, self.rope)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * self.v_dim))
