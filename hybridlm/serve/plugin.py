"""The ``vllm.general_plugins`` entry point: makes vLLM load ``HybridForCausalLM`` exports.

vLLM calls :func:`register` in every process it starts (API server, engine, workers), so it must be cheap
and safe to repeat.
"""
import torch
from transformers import AutoConfig
from vllm import ModelRegistry, envs
from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

from hybridlm import patches
from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridForCausalLM
from hybridlm.serve.config import ServedHybridConfig
from hybridlm.serve.mapping import MLA_CACHE_ENV, latent_size, mla_cache_mode

# the architecture name save_pretrained writes into config.json, and where vLLM imports the served class from
# (a string: vLLM imports it only when a folder names the architecture)
ARCHITECTURE = HybridForCausalLM.__name__
SERVED_CLASS = "hybridlm.serve.model:HybridLMForCausalLM"
log = init_logger(__name__)


class ServedHybridArchConvertor(ModelArchConfigConvertorBase):
    """How vLLM reads an export's attention (registered for the ``hybrid_lm`` model type in
    ``MODEL_ARCH_CONFIG_CONVERTORS``, as vLLM's own convertors are per model type). vLLM turns its latent MLA path on
    for the model types whose convertor answers :meth:`is_deepseek_mla`; with ``HYBRIDLM_VLLM_MLA_CACHE=latent``
    this one does, and the attention's head size is then the latent's (``kv_lora_rank + qk_rope_head_dim``: one
    cache entry per token and layer, shared by every head). Otherwise the MLA layers are per-head attention at the
    padded head size of :class:`ServedHybridConfig`."""

    def is_deepseek_mla(self) -> bool:
        return mla_cache_mode() == "latent" and "mla" in getattr(self.hf_text_config, "layer_plan", ())

    def get_head_size(self) -> int:
        if self.is_deepseek_mla() and not envs.VLLM_MLA_DISABLE:
            return latent_size(self.hf_text_config)
        return self.hf_text_config.head_dim


class ServedHybridSettings(VerifyAndUpdateConfig):
    """vLLM's per-architecture settings hook, run once on the engine's config before any worker starts."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model = vllm_config.model_config
        if model.use_mla:
            size = latent_size(model.hf_config)
            if current_platform.is_cpu():
                # vLLM 0.32's CPU MLA backend compiles its decode kernel for DeepSeek's 512 + 64 only
                raise ConfigError(f"{MLA_CACHE_ENV}=latent: vLLM's CPU MLA kernel takes a 576-value latent "
                                  f"(512 + 64) only; this export's is {size}: serve it with the per-head cache "
                                  f"({MLA_CACHE_ENV}=heads) on CPU")
            if model.dtype not in (torch.float16, torch.bfloat16):
                # TRITON_MLA, the MLA backend that takes any latent size, runs fp16 / bf16
                raise ConfigError(f"{MLA_CACHE_ENV}=latent: vLLM's MLA backends run fp16 or bf16, not {model.dtype}: "
                                  "serve with --dtype bfloat16")
        cache = vllm_config.cache_config
        if current_platform.is_cpu() and cache.enable_prefix_caching:
            # vLLM's CPU Mamba2 scan returns only each sequence's final state, not the per-chunk states that prefix
            # caching stores at block boundaries: a prompt longer than a block fails inside MambaMixer2
            log.warning("HybridForCausalLM on CPU: prefix caching turned off (vLLM's CPU Mamba2 scan cannot "
                        "store block states)")
            cache.enable_prefix_caching = False


def register() -> None:
    # vLLM reads config.json through AutoConfig: the served config (with the attention shape vLLM sizes its
    # cache pages from) for the "hybrid_lm" type, with no remote code
    AutoConfig.register(ServedHybridConfig.model_type, ServedHybridConfig, exist_ok=True)
    # the settings hook and the attention reader, in vLLM's maps (hybridlm/patches.py: they have no registration API)
    patches.apply("vllm-hybrid-config", ARCHITECTURE, ServedHybridSettings, ServedHybridConfig.model_type,
                  ServedHybridArchConvertor)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, SERVED_CLASS)
