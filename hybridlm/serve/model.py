"""The export as a vLLM model: ``HybridForCausalLM`` folders served by vLLM's engine.

Each block is ``x + sublayer(norm(x))`` as in :mod:`hybridlm.model.modeling`, with vLLM's layers inside:

* Mamba2: vLLM's ``MambaMixer2`` (its conv and SSD kernels, its state cache), weights re-laid out at load
  (:mod:`hybridlm.serve.mapping`); the SSD state is fp32 unless ``--mamba-ssm-cache-dtype`` says otherwise.
* MLA: our projections, latent norms and RoPE (``rope_inv_freq`` included), then either vLLM's paged
  ``Attention`` over the decompressed heads, zero-padded to a head size its kernels take (the default; the cache
  holds per-head keys and values), or, with ``HYBRIDLM_VLLM_MLA_CACHE=latent``, vLLM's ``MLAAttention`` over the
  latent (the plugin's convertor makes vLLM read the export as latent attention, ``ModelConfig.use_mla``; CUDA and
  fp16 / bf16 only: vLLM's CPU MLA kernel takes only DeepSeek's 512 + 64 latent).
* MLP: SwiGLU on vLLM's merged gate/up projection.

Each mixer's served layer is the one its registry entry names (``serve_layer``: :class:`ServedMamba2`,
:func:`served_mla`); the MLP, not a mixer, is built here.

One device: tensor and pipeline parallelism are refused (the MLA projections are not sharded).
"""
from __future__ import annotations

from typing import Iterable, Optional, Set, Tuple

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator, MambaStateShapeCalculator
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.utils import maybe_prefix
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_kv_cache_torch_dtype

from hybridlm.config.errors import ConfigError
from hybridlm.model.layers.rope import apply_rope, rope_cos_sin
from hybridlm.model.registry import MLP_KIND, load_object, mixer_spec
from hybridlm.serve.mapping import attention_head_size, check_servable, mamba2_widths, served_weights


def state_dtypes(vllm_config: VllmConfig) -> Tuple[torch.dtype, torch.dtype]:
    """(conv state, SSD state) dtypes: the conv state as vLLM's ``--mamba-cache-dtype`` gives it, the SSD state
    fp32 unless ``--mamba-ssm-cache-dtype`` names another (vLLM's "auto" would follow the model's bf16: the state
    sums every past token, and the toolkit's own generation keeps it in fp32)."""
    cache = vllm_config.cache_config
    conv = get_kv_cache_torch_dtype(cache.mamba_cache_dtype, vllm_config.model_config.dtype)
    ssm = cache.mamba_ssm_cache_dtype
    ssm = torch.float32 if ssm == "auto" else STR_DTYPE_TO_TORCH_DTYPE[ssm]
    return conv, ssm


class ServedMamba2(MambaMixer2):
    """vLLM's Mamba2 mixer with the SSD state dtype of :func:`state_dtypes` (the ``mamba2`` entry's
    ``serve_layer``)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        a, w = config.mixer_args("mamba2"), mamba2_widths(config)
        super().__init__(hidden_size=config.hidden_size, ssm_state_size=a.d_state, conv_kernel_size=a.conv_size,
                         intermediate_size=a.d_inner, use_conv_bias=a.conv_bias, use_bias=a.gate_bias,
                         n_groups=a.n_groups, num_heads=w.heads, head_dim=a.head_dim, rms_norm_eps=a.norm_eps,
                         activation="silu", model_config=vllm_config.model_config,
                         cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config, prefix=prefix)
        self._state_dtypes = state_dtypes(vllm_config)

    def get_state_dtype(self) -> Tuple[torch.dtype, torch.dtype]:
        return self._state_dtypes

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)


class _MLAProjections(nn.Module):
    """MLA's projections, latent norms and RoPE as the export has them; the attention is the subclass's."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str, kv_b_linear=ReplicatedLinear):
        super().__init__()
        a, d = config.mixer_args("mla"), config.hidden_size
        self.heads, self.nope, self.rope, self.v_dim = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = a.kv_lora_rank, a.q_lora_rank
        self.rope_theta = a.rope_theta
        self.rope_inv_freq = tuple(a.rope_inv_freq) if a.rope_inv_freq else None
        self.scale = (self.nope + self.rope) ** -0.5
        qk = self.nope + self.rope

        def linear(n_in, n_out, name, kind=ReplicatedLinear):
            return kind(n_in, n_out, bias=False, quant_config=vllm_config.quant_config, prefix=f"{prefix}.{name}")

        if self.q_lora_rank:
            self.q_a_proj = linear(d, self.q_lora_rank, "q_a_proj")
            self.q_a_norm = RMSNorm(self.q_lora_rank, eps=a.norm_eps) if a.latent_norm else nn.Identity()
            self.q_b_proj = linear(self.q_lora_rank, self.heads * qk, "q_b_proj")
        else:
            self.q_proj = linear(d, self.heads * qk, "q_proj")
        self.kv_a_proj = linear(d, self.kv_lora_rank + self.rope, "kv_a_proj")
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, eps=a.norm_eps) if a.latent_norm else nn.Identity()
        self.kv_b_proj = linear(self.kv_lora_rank, self.heads * (self.nope + self.v_dim), "kv_b_proj", kv_b_linear)
        self.o_proj = linear(self.heads * self.v_dim, d, "o_proj")

    def project(self, positions: torch.Tensor, x: torch.Tensor):
        """``q [N, H, nope + rope]`` with its RoPE part rotated, the normed latent ``[N, kv_lora_rank]`` and the
        rotated shared RoPE key ``[N, 1, rope]``: the toolkit's own RoPE on the token axis (vLLM's flat
        ``[tokens, ...]`` layout as one row of a batch)."""
        N, H = x.shape[0], self.heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)[0]))[0]
        else:
            q = self.q_proj(x)[0]
        q_nope, q_rope = q.view(N, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj(x)[0].split([self.kv_lora_rank, self.rope], dim=-1)
        cos, sin = rope_cos_sin(positions, self.rope, self.rope_theta, self.rope_inv_freq)
        q = torch.cat([q_nope, apply_rope(q_rope.unsqueeze(0), cos, sin)[0]], dim=-1)
        k_rope = apply_rope(k_rope.view(1, N, 1, self.rope), cos, sin)[0]
        return q, self.kv_a_norm(c_kv), k_rope


class _MLA(_MLAProjections):
    """Multi-head latent attention with our projections and RoPE, attending through vLLM's paged attention over
    per-head keys and values decompressed by kv_b (``HYBRIDLM_VLLM_MLA_CACHE=heads``, the default)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, vllm_config, prefix)
        self.head_size = attention_head_size(config)
        # one KV head per query head: MLA decompresses a key and a value for every head
        self.attn = Attention(self.heads, self.head_size, self.scale, num_kv_heads=self.heads,
                              cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                              prefix=f"{prefix}.attn")

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """[N, H, n] -> [N, H * head_size], zeros after the n values of each head."""
        return nn.functional.pad(t, (0, self.head_size - t.shape[-1])).reshape(t.shape[0], -1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        N, H = x.shape[0], self.heads
        q, latent, k_rope = self.project(positions, x)
        k_nope, v = self.kv_b_proj(latent)[0].view(N, H, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(N, H, self.rope)], -1)
        o = self.attn(self._pad(q), self._pad(k), self._pad(v))
        o = o.view(N, H, self.head_size)[..., :self.v_dim].reshape(N, H * self.v_dim)
        return self.o_proj(o)[0]


class _LatentMLA(_MLAProjections):
    """MLA served from its latent (``HYBRIDLM_VLLM_MLA_CACHE=latent``): vLLM's MLA attention caches the normed
    latent and the rotated RoPE key, ``kv_lora_rank + qk_rope_head_dim`` values per token and layer (what
    ``upcycle kv-report`` counts), attends prefill tokens through kv_b's decompressed heads and decode tokens in the
    latent space, kv_b folded into the query and the output (vLLM's ``split_kv_b_proj``: the export's kv_b rows
    are per head [nope | v], as DeepSeek's)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, vllm_config, prefix, kv_b_linear=ColumnParallelLinear)
        self.attn = MLAAttention(num_heads=self.heads, scale=self.scale, qk_nope_head_dim=self.nope,
                                 qk_rope_head_dim=self.rope, v_head_dim=self.v_dim,
                                 q_lora_rank=self.q_lora_rank or None, kv_lora_rank=self.kv_lora_rank,
                                 kv_b_proj=self.kv_b_proj, cache_config=vllm_config.cache_config,
                                 quant_config=vllm_config.quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, latent, k_rope = self.project(positions, x)
        o = self.attn(q, latent, k_rope, output_shape=(x.shape[0], self.heads * self.v_dim))
        return self.o_proj(o)[0]


class _MLP(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(d, [f, f], bias=False, quant_config=vllm_config.quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(f, d, bias=False, quant_config=vllm_config.quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)[0]))[0]


def served_mla(config, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """The ``mla`` entry's ``serve_layer``: MLA over its latent where vLLM reads the export as latent attention
    (``HYBRIDLM_VLLM_MLA_CACHE=latent``), over per-head keys and values otherwise."""
    layer = _LatentMLA if vllm_config.model_config.use_mla else _MLA
    return layer(config, vllm_config, prefix)


def _sublayer(kind: str):
    """The served layer of ``kind``, ``layer(config, vllm_config, prefix)``: a mixer's registry ``serve_layer``, or
    the MLP."""
    return _MLP if kind == MLP_KIND else load_object(mixer_spec(kind).serve_layer)


class _Block(nn.Module):
    """``x + mixer(norm(x))``; the residual add is fused into the next norm, as vLLM's models do."""

    def __init__(self, config, kind: str, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = _sublayer(kind)(config, vllm_config, f"{prefix}.mixer")

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(positions, hidden), residual


class _Model(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(_Block(config, kind, vllm_config, f"{prefix}.layers.{i}")
                                    for i, kind in enumerate(config.layer_plan))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, inputs_embeds=None):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class HybridLMForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """A ``HybridForCausalLM`` export (MLA, Mamba2 and MLP layers) on vLLM."""

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> Tuple[torch.dtype, torch.dtype]:
        return state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_config
        check_servable(config)
        a, w = config.mixer_args("mamba2"), mamba2_widths(config)
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=vllm_config.parallel_config.tensor_parallel_size, intermediate_size=w.d_inner,
            n_groups=a.n_groups, num_heads=w.heads, head_dim=a.head_dim, state_size=a.d_state,
            conv_kernel=a.conv_size, num_spec=vllm_config.num_speculative_tokens)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba2_state_copy_func()

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_servable(config)
        if get_tensor_model_parallel_world_size() > 1 or get_pp_group().world_size > 1:
            raise ConfigError("tensor_parallel_size / pipeline_parallel_size: the served hybrid runs on one device "
                              "(1 each)")
        self.config = config
        self.model = _Model(vllm_config, maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """The export's weights through :func:`hybridlm.serve.mapping.served_weights`; a name the model does not
        have, or a parameter the export does not fill, is an error naming it."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in served_weights(self.config, weights):
            if name not in params:
                raise ConfigError(f"{self.config.name_or_path}: weight {name}: no such parameter in the served model "
                                  f"(is the folder a HybridForCausalLM export?)")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)  # a tied lm_head is the embeddings' parameter, listed once
        if missing:
            raise ConfigError(f"{self.config.name_or_path}: weights missing from the export: {', '.join(missing[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}")
        return loaded
