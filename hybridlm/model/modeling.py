"""The hybrid causal LM: embeddings -> [pre-norm sublayer + residual] x num_layers -> norm -> LM head.

``HybridForCausalLM`` is a transformers ``PreTrainedModel``: ``save_pretrained`` / ``from_pretrained``
work and loading is strict (see :meth:`HybridForCausalLM.from_pretrained`). A saved folder holds no code
(``save_pretrained(..., remote_code=True)`` is the opt-in); ``import hybridlm.model`` makes the Auto classes load it.

Generation: ``model.generate`` (or ``forward(..., use_cache=True)``) carries a
:class:`~hybridlm.model.cache.HybridCache`; ``attention_mask`` (left padding) and ``position_ids`` are honoured.
Without any of cache / mask / positions the forward is the training path, untouched.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Union

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from hybridlm.model.cache import HybridCache, InferenceContext
from hybridlm.model.configuration import HybridConfig, write_remote_code
from hybridlm.model.fast_generate import fast_path_plan, say_why
from hybridlm.model.graphs import graphed_generate, release_kept_decoder
from hybridlm.model.layers import RMSNorm, build_sublayer
from hybridlm.model.layers.conv import ShortConv
from hybridlm.model.layers.init import init_short_conv
from hybridlm.model.loss import IGNORE_INDEX, linear_cross_entropy
from hybridlm.model.registry import mixers
from hybridlm.model.runtime import RuntimeSettings, runtime_settings
from hybridlm.ops.backend import residual_adds_in_norms_active, use_triton
from hybridlm.ops.tuning import install_shipped_tuning
from hybridlm.utils.quiet import no_transformers_bars

# transformers renamed the output's cache field past_key_values -> cache (5.2x); fill the one this version has
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class HybridCausalLMOutput(CausalLMOutputWithPast):
    """transformers' causal-LM output; ``.cache`` reads the cache under either transformers' field name (the
    GPU machine's transformers 5.17 still calls it ``past_key_values``)."""
    if _CACHE_FIELD != "cache":
        @property
        def cache(self) -> Optional[HybridCache]:
            return self.past_key_values


class HybridBlock(nn.Module):
    """One sublayer of the pattern with its pre-norm and residual: ``x + sublayer(norm(x))``."""

    def __init__(self, config: HybridConfig, kind: str, layer_idx: int):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.runtime)
        self.mixer = build_sublayer(config, kind, layer_idx)

    def forward(self, x: torch.Tensor, ctx: Optional[InferenceContext] = None) -> torch.Tensor:
        return x + self.mixer(self.norm(x), ctx)


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridBlock"]
    _supports_sdpa = True

    def save_pretrained(self, save_directory, *args, remote_code: bool = False, **kwargs):
        """transformers' ``save_pretrained``: weights, config.json, generation_config.json, and no code unless
        ``remote_code=True``, which adds ``hybrid_lm_auto.py`` and an ``auto_map``
        (:func:`~hybridlm.model.configuration.write_remote_code`: whoever loads the folder with
        ``trust_remote_code=True`` runs that file)."""
        with no_transformers_bars():
            super().save_pretrained(save_directory, *args, **kwargs)
        if remote_code and kwargs.get("is_main_process", True):
            write_remote_code(save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """A no-op, as :meth:`HybridConfig.register_for_auto_class`: no saved folder gets a copy of this module."""

    @property
    def runtime(self) -> RuntimeSettings:
        """How this model runs (backend, fusions, loss chunking; not saved with it): :meth:`set_runtime` changes it."""
        return self.config.runtime

    def set_runtime(self, settings: Union[None, RuntimeSettings, Mapping[str, Any]] = None, **changes) -> None:
        """Run this model with other settings: ``settings`` (a :class:`RuntimeSettings` or a mapping; None keeps the
        current ones) updated with ``changes``, e.g. ``model.set_runtime(backend="torch")``. Checked first: an
        invalid value raises ``ConfigError`` and nothing changes. Every module of the model reads the new object."""
        base = dataclasses.asdict(self.runtime if settings is None else runtime_settings(settings))
        new = runtime_settings({**base, **changes})
        self.config.runtime = new
        for module in self.modules():
            if isinstance(vars(module).get("runtime"), RuntimeSettings):  # the layers' references
                module.runtime = new

    def _init_weights(self, module: nn.Module) -> None:
        """fla's from-scratch init (docs/initialisation.md): linears, short convs and embeddings normal(0,
        initializer_range), biases 0, norm weights 1, the mixers' A_log / dt_bias / D by their own
        ``reset_recurrent_parameters``; Mamba2's out_proj depth-scaled as in fla's Mamba2 and its conv at
        PyTorch's Conv1d default as in mamba_ssm, by its registry ``init`` (transformers applies this to children
        before parents, so a mixer's ``init`` overrides the nn.Linear and ShortConv branches)."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ShortConv):
            init_short_conv(module, std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        if hasattr(module, "reset_recurrent_parameters"):
            module.reset_recurrent_parameters()
            for name in ("o_norm_weight", "norm_weight"):
                if hasattr(module, name):
                    nn.init.ones_(getattr(module, name))
        for spec in mixers():  # a mixer's own init (the registry's ``init``) after the branches above
            if spec.init is not None and isinstance(module, spec.module):
                spec.init(module, self.config)


class HybridModel(HybridPreTrainedModel):
    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(config, kind, i) for i, kind in enumerate(config.layer_plan))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.runtime)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids: Optional[torch.LongTensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None,
                cache: Optional[HybridCache] = None,
                hidden_states: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Final-norm hidden states. ``attention_mask [B, past + T]`` (0 = padding), ``position_ids`` and
        ``cache`` (updated in place) switch the sublayers to their inference path. ``hidden_states``, a list, receives
        transformers' ``output_hidden_states`` tuple: the embeddings, then each block's output, the last one
        after the final norm (``num_hidden_layers + 1`` tensors)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        ctx = None
        if cache is not None or attention_mask is not None or position_ids is not None:
            ctx = InferenceContext.build(cache, attention_mask, position_ids, x.shape[1], x.device)
        if hidden_states is None and self._residual_adds_in_norms():
            return self._forward_residual_adds_in_norms(x, ctx)
        for layer in self.layers:
            if hidden_states is not None:
                hidden_states.append(x)
            if self.gradient_checkpointing and self.training:
                x = self._gradient_checkpointing_func(layer.__call__, x, ctx)
            else:
                x = layer(x, ctx)
        x = self.norm(x)
        if hidden_states is not None:
            hidden_states.append(x)
        return x

    def _forward_residual_adds_in_norms(self, x: torch.Tensor, ctx: Optional[InferenceContext]) -> torch.Tensor:
        """The blocks' function with each block's residual add left to the next norm (one fused kernel on fla's
        path; the torch path adds, then normalises, as the blocks do)."""
        delta = None
        for layer in self.layers:
            h, x = layer.norm.add_and_normalise(x, delta)
            delta = layer.mixer(h, ctx)
        return self.norm.add_and_normalise(x, delta)[0]

    def _residual_adds_in_norms(self) -> bool:
        """Training (``runtime.fuse_residual_norm``, as fla's models train) and a captured decode step
        (:func:`~hybridlm.ops.backend.residual_adds_in_norms`) leave each residual add to the next norm; a hooked
        block or gradient checkpointing (which wraps each block's call) keeps the block loop."""
        if self._blocks_hooked():
            return False
        if self.training:
            return self.config.runtime.fuse_residual_norm and not self.gradient_checkpointing
        return residual_adds_in_norms_active()

    def _blocks_hooked(self) -> bool:
        """A hook on a block expects the block's own call (its input, its output): keep the block loop then."""
        return any(layer._forward_hooks or layer._forward_pre_hooks for layer in self.layers)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _is_stateful = True  # recurrent states cannot be rolled back (no assisted decoding)

    def __init__(self, config: HybridConfig, runtime: Union[None, RuntimeSettings, Mapping[str, Any]] = None):
        """``runtime``: how to run it (:class:`~hybridlm.model.runtime.RuntimeSettings` or a mapping of them; not
        saved); None keeps ``config.runtime`` (the defaults unless set). ``from_pretrained(path, runtime=...)``
        passes it too."""
        if runtime is not None:
            config.runtime = runtime
        super().__init__(config)
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        # on a CUDA host, the shipped kernel tuning in place before any of this model's kernels can launch (once a
        # process; no CUDA context made; the status line is the training loop's first-step notice's to say)
        install_shipped_tuning()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def generate(self, inputs: Optional[torch.Tensor] = None, generation_config=None, **kwargs):
        """transformers' ``generate()``; on CUDA, a call that a static cache and one captured decode step serve
        exactly (rows of one length and no padding, greedy or temperature / top-k sampling, one EOS, a token
        tensor returned; judged on the call's settings as transformers resolves them, its defaults included) goes
        through :func:`hybridlm.model.graphs.graphed_generate` instead, and any other says once why it does not
        (:mod:`hybridlm.model.fast_generate`). ``fast_path=False`` always takes transformers' loop; ``True`` takes
        the static cache on a CPU too (no graph there: the same tokens). Either way the random state and
        transformers' warnings after the call are those transformers' loop leaves. The fast path keeps its static
        cache and captured step on the model for the next call of the same batch size (:meth:`release_generation_graph`
        frees them); a call made while another thread's call uses them, a model with forward hooks, and sampling in
        half precision on CUDA take transformers' loop (docs/generation.md)."""
        plan, why = fast_path_plan(self, inputs, generation_config, kwargs)
        if plan is not None:
            return graphed_generate(self, **plan)
        say_why(why)
        kwargs.pop("fast_path", None)
        return super().generate(inputs, generation_config, **kwargs)

    def release_generation_graph(self) -> None:
        """Free the static cache and CUDA graph that ``generate()``'s fast path keeps for its next call."""
        release_kept_decoder(self)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate must not build a DynamicCache: it gets a HybridCache (below)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' cache set-up, then, where it made none and the call uses a cache, an empty dynamic
        :class:`HybridCache` (what ``forward(use_cache=True)`` would build): generate's chunked prefill
        (``prefill_chunk_size``) needs the cache before the first forward."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if (generation_config.use_cache is not False and model_kwargs.get("cache") is None
                and model_kwargs.get("past_key_values") is None):
            model_kwargs[_CACHE_FIELD] = HybridCache(self.config)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        shift_labels: Optional[torch.LongTensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
        return_logits: Optional[bool] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[HybridCache] = None,
        past_key_values: Optional[HybridCache] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> HybridCausalLMOutput:
        """``labels`` follow transformers (aligned with ``input_ids``, shifted here); ``shift_labels`` are
        already the next-token targets. With either, the loss is computed chunk-wise and logits are not
        returned unless ``return_logits=True``. ``logits_to_keep=k`` keeps only the last k positions.

        Generation: ``cache`` (or its older name ``past_key_values``) is a :class:`HybridCache` holding the
        tokens seen so far, updated in place and returned as ``output.cache``; ``use_cache=True`` creates one.
        ``attention_mask`` covers cached + new tokens (0 = padding, left padding for batches);
        ``position_ids`` default to the mask's running count. ``cache_position`` is not needed.

        ``output_hidden_states`` (or ``config.output_hidden_states``) returns ``hidden_states`` as transformers'
        Auto classes do: the embeddings, then each block's output, the last one after the final norm.
        ``output_attentions`` is refused: MLA attends through compressed latents (absorbed weights when decoding)
        and the Mamba2 / GDN / KDA mixers have no attention matrix, so there are no weights to return."""
        if output_attentions if output_attentions is not None else getattr(self.config, "output_attentions", False):
            raise NotImplementedError(
                f"{type(self).__name__} returns no attention weights (output_attentions=True): its MLA layers "
                f"attend through compressed latents and its Mamba2 / GDN / KDA layers are recurrent, with no "
                f"attention matrix; pass output_attentions=False")
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        cache = self._resolve_cache(past_key_values if cache is None else cache, use_cache)
        states = [] if output_hidden_states else None
        hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                            position_ids=position_ids, cache=cache, hidden_states=states)
        states = tuple(states) if states is not None else None
        loss = None
        if labels is not None and shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if shift_labels is not None:
            loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                        shift_labels.reshape(-1), self.config.runtime.loss_chunks,
                                        triton=use_triton(self.config.runtime.backend, hidden),
                                        loss_kernel=self.config.runtime.loss_kernel)
            if not return_logits:
                return HybridCausalLMOutput(loss=loss, logits=None, hidden_states=states)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return HybridCausalLMOutput(loss=loss, logits=self.lm_head(hidden).float(), hidden_states=states,
                                    **{_CACHE_FIELD: cache})

    def _resolve_cache(self, cache, use_cache: Optional[bool]) -> Optional[HybridCache]:
        if cache is None:
            return HybridCache(self.config) if use_cache else None
        if not isinstance(cache, HybridCache):
            raise TypeError(f"{type(self).__name__} caches MLA latents and recurrent states: pass a HybridCache "
                            f"(or use_cache=True), not a {type(cache).__name__}")
        return cache


def _strict_from_pretrained(cls, *args, **kwargs):
    """``from_pretrained`` that refuses missing or unexpected weights instead of silently re-initialising them
    (and draws no weight-loading bar)."""
    want_info = kwargs.pop("output_loading_info", False)
    with no_transformers_bars():
        model, info = PreTrainedModel.from_pretrained.__func__(cls, *args, output_loading_info=True, **kwargs)
    problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        detail = "; ".join(f"{k}: {', '.join(map(str, v[:5]))}{' ...' if len(v) > 5 else ''}" for k, v in problems.items())
        raise ValueError(f"{source}: checkpoint does not match {cls.__name__} ({detail})")
    return (model, info) if want_info else model


HybridPreTrainedModel.from_pretrained = classmethod(_strict_from_pretrained)
