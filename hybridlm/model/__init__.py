"""The hybrid model definition every stage imports."""
from transformers import AutoConfig, AutoModelForCausalLM

from hybridlm.model.configuration import HybridConfig
from hybridlm.model.modeling import HybridForCausalLM, HybridModel

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = ["HybridConfig", "HybridForCausalLM", "HybridModel"]
