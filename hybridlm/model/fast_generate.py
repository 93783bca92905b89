"""``model.generate()``'s fast path: the calls a static cache and a captured decode step can serve exactly.

transformers' ``generate()`` decodes eagerly, one Python-launched kernel at a time; for a small hybrid the
launches, not the GPU, set the speed. :func:`fast_path_plan` looks at a ``generate()`` call and, when
:func:`hybridlm.model.graphs.graphed_generate` computes the same thing (one prompt length: no padding; greedy or
temperature / top-k sampling; one EOS; no beam search, streamer, custom processors or score outputs), returns
its arguments; otherwise the reason it cannot, which :meth:`HybridForCausalLM.generate` says once before taking
transformers' own loop. Tokens are the same either way (tests/test_generation.py, tests/gpu).
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Dict, Optional, Tuple

import torch
from transformers import GenerationConfig

logger = logging.getLogger(__name__)

# generation settings graphed_generate honours; any other one that differs from transformers' default sends the
# call down transformers' loop (e.g. num_beams, top_p, repetition_penalty, output_scores)
HONOURED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "eos_token_id", "pad_token_id",
            "bos_token_id", "use_cache", "transformers_version", "_from_model_config"}
# keyword arguments of a call the fast path takes (the rest: transformers' generate arguments or model inputs)
CALL_KEYS = {"input_ids", "attention_mask", "fast_path"}
# values that leave a setting without effect (transformers' defaults are mostly None)
NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
           "length_penalty": 1.0, "min_length": 0, "min_new_tokens": 0, "no_repeat_ngram_size": 0}
_SAID = set()


def fast_path_plan(model, inputs: Optional[torch.Tensor], generation_config: Optional[GenerationConfig],
                   kwargs: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """(graphed_generate's keyword arguments, "") when the call can take the fast path, else (None, why).
    ``kwargs["fast_path"]``: None (default) takes it on CUDA only, True also on a CPU (static cache, no graph:
    the same tokens, for testing), False never."""
    wanted = kwargs.get("fast_path")
    if wanted is False or (wanted is None and model.device.type != "cuda"):
        return None, ""  # asked not to, or a CPU model's normal path: nothing to say
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return None, "no [batch, length] input_ids"
    other = sorted(set(kwargs) - CALL_KEYS)
    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = gc.update(**{k: kwargs[k] for k in other})  # generation settings in, the rest back out
    if unused:
        return None, f"argument {sorted(unused)[0]!r}"
    default = GenerationConfig().to_dict()
    changed = sorted(k for k, v in gc.to_dict().items() if k not in HONOURED and v != default.get(k)
                     and v not in (None, False) and NEUTRAL.get(k, object()) != v)
    if changed:
        return None, f"generation setting {changed[0]}={getattr(gc, changed[0])!r}"
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        return None, "padded rows (attention_mask has zeros)"
    eos = gc.eos_token_id
    if isinstance(eos, (list, tuple)):
        if len(eos) > 1:
            return None, f"several EOS ids {list(eos)}"
        eos = eos[0] if eos else None
    new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - input_ids.shape[1]
    if new is None or new < 1:
        return None, "no room for new tokens (max_new_tokens / max_length)"
    if gc.use_cache is False:
        return None, "use_cache=False"
    plan = {"input_ids": input_ids, "max_new_tokens": int(new), "eos_token_id": eos,
            "pad_token_id": gc.pad_token_id, "do_sample": bool(gc.do_sample)}
    if gc.do_sample:
        plan.update(temperature=float(gc.temperature if gc.temperature is not None else 1.0),
                    top_k=int(gc.top_k) if gc.top_k else None)
    return plan, ""


def say_why(reason: str) -> None:
    """Log, once per reason, why a CUDA ``generate()`` call took transformers' loop."""
    if reason and reason not in _SAID:
        _SAID.add(reason)
        logger.warning("generate(): transformers' eager loop, not the CUDA-graph fast path: %s "
                       "(said once per reason)", reason)
