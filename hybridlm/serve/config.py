"""The export's config as vLLM reads it.

vLLM sizes the KV cache pages of a hybrid from the model config's ``num_attention_heads``,
``num_key_value_heads`` and ``head_dim`` (the attention pages must be as large as a Mamba2 state). A
``HybridConfig`` keeps its attention shape in its ``mla`` section; :class:`ServedHybridConfig` adds those three
names, with the values the served MLA layers run at (:mod:`hybridlm.serve.model`: one KV head per query head,
heads padded to :func:`~hybridlm.serve.mapping.attention_head_size`). The plugin registers it for the
``hybrid_lm`` model type in vLLM's processes only; the toolkit's own loading keeps ``HybridConfig``.
"""
from __future__ import annotations

from hybridlm.model import HybridConfig
from hybridlm.serve.mapping import attention_head_size


class ServedHybridConfig(HybridConfig):
    def __init__(self, **kwargs):
        # an __init__ of its own: transformers replaces a config subclass's missing __init__ with a dataclass
        # one, which would skip HybridConfig's (no layer plan, no mixer settings)
        super().__init__(**kwargs)

    @property
    def num_attention_heads(self) -> int:
        return self.mixer_args("mla").num_heads if "mla" in self.layer_plan else 0

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return attention_head_size(self) if "mla" in self.layer_plan else 0
