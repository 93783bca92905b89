"""The ``vllm.general_plugins`` entry point: makes vLLM load ``HybridForCausalLM`` exports.

vLLM calls :func:`register` in every process it starts (API server, engine, workers), so it must be cheap
and safe to repeat.
"""
from transformers import AutoConfig
from vllm import ModelRegistry
from vllm.logger import init_logger
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
from vllm.platforms import current_platform

from hybridlm.model import HybridForCausalLM
from hybridlm.serve.config import ServedHybridConfig

# the architecture name save_pretrained writes into config.json, and where vLLM imports the served class from
# (a string: vLLM imports it only when a folder names the architecture)
ARCHITECTURE = HybridForCausalLM.__name__
SERVED_CLASS = "hybridlm.serve.model:HybridLMForCausalLM"
log = init_logger(__name__)


class ServedHybridSettings(VerifyAndUpdateConfig):
    """vLLM's per-architecture settings hook, run once on the engine's config before any worker starts."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
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
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ServedHybridSettings)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, SERVED_CLASS)
