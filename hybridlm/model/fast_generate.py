"""``model.generate()``'s fast path: the calls a static cache and a captured decode step can serve exactly.

transformers' ``generate()`` decodes eagerly, one Python-launched kernel at a time; for a small hybrid the
launches, not the GPU, set the speed. :func:`fast_path_plan` looks at a ``generate()`` call the way transformers'
``generate()`` does: it resolves the call's generation config with transformers' own code (the model's
generation config, transformers' global defaults such as ``max_length=20`` and ``top_k=50``, the call's
arguments), infers the attention mask from ``pad_token_id`` as transformers does, and builds the logits processors
and stopping criteria transformers' loop would run. When :func:`hybridlm.model.graphs.graphed_generate` computes
the same thing (rows of one length and no padding; greedy, or sampling whose only processors are temperature and
top-k; at most one EOS; a plain token tensor returned) it returns graphed_generate's arguments; otherwise the
reason it cannot, which :meth:`HybridForCausalLM.generate` says once before taking transformers' own loop.
Tokens are the same either way (tests/test_generate_fast_path.py, tests/gpu). So are transformers' warnings and
log messages: what its setup code says while the call is judged is held back (:class:`HeldBack`), then said when
the fast path is taken and dropped when the loop is (the loop says it itself). The judging runs the transformers
code that warns about a batch without an attention mask and about a ``compile_config`` it cannot honour, and
repeats, with its text, the right-padding check that generate() makes inline.

Besides the settings, three things send a call down the loop: forward hooks on the model (the fast path's model
calls are not the loop's; a captured step runs no hook), another thread's call using the model's kept static cache
(one call at a time uses it: :class:`hybridlm.model.graphs.KeptDecoder`), and sampling in bf16 / fp16 on CUDA (the
captured step's half-precision logits differ from the loop's in the last bits; on a CPU the static cache's eager
step is the loop's, :data:`hybridlm.model.cache.FIXED_SHAPES`).
"""
from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.nn.modules import module as nn_module
from transformers import GenerationConfig
from transformers.generation import utils as generation_utils
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from hybridlm import patches
from hybridlm.model.graphs import kept_decoder_busy

logger = logging.getLogger(__name__)

# transformers' generate() arguments that are not generation settings: any of them with a value sends the call down
# transformers' loop (the fast path runs no custom processor, criterion, streamer, assistant or custom loop)
GENERATE_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                      "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                      "custom_generate", "assistant_tokenizer")
# arguments transformers' generate() takes that change nothing when no setting uses them (``tokenizer`` serves
# stop_strings and token_healing, both refused below; ``trust_remote_code`` serves a hub custom_generate)
INERT_ARGUMENTS = ("tokenizer", "trust_remote_code")
# model inputs the fast path takes; any other one (a cache, position_ids, inputs_embeds, ...) sends the call down
# transformers' loop
MODEL_INPUTS = ("input_ids", "attention_mask")
# resolved generation settings the checks below account for: the length settings (transformers' stopping criteria
# and length processors), everything transformers turns into logits processors or stopping criteria (read back from
# the processors and criteria it builds), the generation mode's settings, and those checked one by one. Any other
# setting that differs from transformers' defaults sends the call down transformers' loop.
ACCOUNTED = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time", "stop_strings",
    "do_sample", "num_beams", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff",
    "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "renormalize_logits", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "sequence_bias", "guidance_scale", "watermarking_config", "is_assistant",
    "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
    "use_cache", "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores",
    "output_logits", "return_dict_in_generate", "token_healing", "prefill_chunk_size", "cache_implementation",
    "cache_config", "max_cache_len",
    # no effect here: compilation needs a compileable cache (HybridCache is not), the rest are bookkeeping
    "compile_config", "disable_compile", "transformers_version", "_from_model_config",
}
# settings checked one by one: the value each must have (or None) for the fast path
PLAIN = {"use_cache": True, "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False,
         "output_scores": False, "output_logits": False, "return_dict_in_generate": False, "token_healing": False,
         "prefill_chunk_size": None, "cache_implementation": None, "cache_config": None, "max_cache_len": None}
_SAID = set()
# why the fast path declines a call with forward hooks: its model calls are not the loop's (other inputs, and
# up to STOP_CHECK_EVERY - 1 steps past the last EOS), and a captured CUDA-graph step calls no Python hook
HOOKED = ("forward hooks on the model (transformers' loop calls the model, and its hooks, once a step; the fast "
          "path's captured step runs no hook)")
# why a concurrent call takes the loop: the kept static cache and graph serve one call at a time
BUSY = "another generate() call is using this model's static cache (a concurrent call takes transformers' loop)"
HALF = (torch.float16, torch.bfloat16)
# why half-precision sampling on CUDA takes the loop: the captured step computes the loop's function with other
# kernels (fused norms and residual adds, attention over the whole static cache under a mask), so its half-precision
# logits differ from the loop's in the last bits and a seeded draw can pick another token (greedy keeps the fast
# path: an argmax moves only at a near-tie). On a CPU the static cache's eager step is the loop's: the same logits.
CAPTURED_STEP_DIFFERS = ("the captured decode step's half-precision logits differ from the loop's in the last "
                         "bits, so seeded draws would differ")


class HeldBack:
    """What transformers says on this thread inside the ``with`` block, held back: records of its loggers,
    its ``warning_once`` / ``info_once`` calls (replayed as calls, so their once-only memory is the loop's) and
    its Python warnings (replayed with the location, registry and module they were raised with). :meth:`say`
    says them in order. Other threads and other libraries are not held. While a block is open anywhere,
    ``logging.Logger.handle``, the two ``*_once`` methods and ``warnings.warn`` are wrapped (hybridlm/patches.py
    ``transformers-messages-held``)."""

    _local = threading.local()

    def __init__(self):
        self.held: List[Callable[[], None]] = []

    @classmethod
    def _holding(cls, name: str) -> Optional[List[Callable[[], None]]]:
        held = getattr(cls._local, "held", None)
        return held if held is not None and (name == "transformers" or name.startswith("transformers.")) else None

    def __enter__(self) -> "HeldBack":
        self._scope = patches.scope("transformers-messages-held", HeldBack._holding)
        self._scope.__enter__()
        self._outer = getattr(HeldBack._local, "held", None)
        HeldBack._local.held = self.held
        return self

    def __exit__(self, *exc) -> None:
        HeldBack._local.held = self._outer
        self._scope.__exit__(None, None, None)

    def say(self) -> None:
        held, self.held = self.held, []
        for said in held:
            said()


def _defaults() -> Dict[str, Any]:
    """The settings a call resolves to when neither the call nor the model sets them (transformers' global
    defaults on top of ``GenerationConfig()``)."""
    base = GenerationConfig().to_dict()
    base.update(getattr(GenerationConfig, "_get_default_generation_params", dict)())
    return base


def _has_value(value) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (list, tuple)) and len(value) == 0:
        return False
    return True


def _resolve(model, generation_config, kwargs):
    """transformers' ``_prepare_generation_config``: (the call's generation config, the remaining model kwargs)."""
    params = inspect.signature(model._prepare_generation_config).parameters
    if "use_model_defaults" in params:  # older transformers 5.x releases
        return model._prepare_generation_config(generation_config, None, **kwargs)
    return model._prepare_generation_config(generation_config, **kwargs)


def fast_path_plan(model, inputs: Optional[torch.Tensor], generation_config: Optional[GenerationConfig],
                   kwargs: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """(graphed_generate's keyword arguments, "") when the call can take the fast path, else (None, why).
    ``kwargs["fast_path"]``: None (default) takes it on CUDA only, True also on a CPU (static cache, no graph:
    the same tokens, for testing), False never."""
    wanted = kwargs.get("fast_path")
    if wanted is False or (wanted is None and model.device.type != "cuda"):
        return None, ""  # asked not to, or a CPU model's normal path: nothing to say
    kwargs = {k: v for k, v in kwargs.items() if k != "fast_path"}
    if _hooked(model):
        return None, HOOKED
    for name in GENERATE_ARGUMENTS:
        if _has_value(kwargs.get(name)):
            return None, f"argument {name!r}"
    settings = {k: v for k, v in kwargs.items() if k not in GENERATE_ARGUMENTS and k not in INERT_ARGUMENTS}
    if inputs is not None and "input_ids" in settings:
        return None, "both inputs and input_ids"
    input_ids = inputs if inputs is not None else settings.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return None, "no [batch, length] input_ids"
    try:
        with HeldBack() as held:  # the loop says it all again when it is taken
            plan, why = _plan(model, input_ids, generation_config, settings, kwargs.get("tokenizer"))
    except Exception as e:  # transformers refuses the call (or its internals differ): its loop says what it says
        return None, f"transformers' generation setup raised {type(e).__name__}: {e}"
    if plan is not None and plan["max_new_tokens"] > 1 and kept_decoder_busy(model):
        return None, BUSY
    if plan is not None:
        held.say()  # what transformers' generate() would have said
    return plan, why


def _hooked(model) -> bool:
    """Forward hooks on the model or any of its modules, or global ones (``nn.modules.module``'s)."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _plan(model, input_ids, generation_config, settings, tokenizer):
    """fast_path_plan past its argument checks: the call as transformers resolves it, judged setting by setting."""
    has_default_max_length = (settings.get("max_length") is None
                              and (generation_config is None or generation_config.max_length is None)
                              and model.generation_config.max_length is None)
    has_default_min_length = (settings.get("min_length") is None
                              and (generation_config is None or generation_config.min_length is None)
                              and model.generation_config.min_length is None)
    gc, model_kwargs = _resolve(model, generation_config, settings)
    other = sorted(k for k, v in model_kwargs.items() if k not in MODEL_INPUTS and v is not None)
    if other:
        return None, f"argument {other[0]!r}"

    mode = gc.get_generation_mode(None)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return None, f"generation mode {mode.value}"
    if mode == GenerationMode.SAMPLE and model.dtype in HALF and input_ids.device.type == "cuda":
        return None, f"sampling in {model.dtype} on CUDA ({CAPTURED_STEP_DIFFERS})"
    for key, plain in PLAIN.items():
        value = getattr(gc, key, None)
        if value is not None and value != plain:
            return None, f"generation setting {key}={value!r}"
    defaults = _defaults()
    for key, value in sorted(gc.to_dict().items()):
        if key not in ACCOUNTED and _has_value(value) and value != defaults.get(key):
            return None, f"generation setting {key}={value!r}"

    B, P = input_ids.shape
    mask = model_kwargs.get("attention_mask")
    # generate()'s warnings about a batch without an attention mask come from here
    model._prepare_special_tokens(gc, mask is not None, device=input_ids.device, batch_size=B)
    if not model.config.is_encoder_decoder and gc._pad_token_tensor is not None and B > 1:
        # generate() checks for right padding inline; the same check, said through its logger with its text
        if mask is not None and tuple(mask.shape) == (B, P):
            right = bool((mask[:, -1] == 0).any())
        else:
            right = bool((input_ids[:, -1] == gc._pad_token_tensor).sum() > 0)
        if right:
            generation_utils.logger.warning(
                "A decoder-only architecture is being used, but right-padding was detected! For correct "
                "generation results, please set `padding_side='left'` when initializing the tokenizer.")
    if mask is not None:
        if tuple(mask.shape) != (B, P):
            return None, f"attention_mask of shape {tuple(mask.shape)} for input_ids of {(B, P)}"
        if not bool(mask.bool().all()):
            return None, "padded rows (attention_mask has zeros)"
    else:  # transformers infers the mask from pad_token_id (unless the pad is an EOS)
        inferred = model._prepare_attention_mask_for_generation(input_ids, gc, {})
        if not bool(inferred.bool().all()):
            return None, f"padded rows (attention_mask inferred from pad_token_id={int(gc._pad_token_tensor)})"

    gc = model._prepare_generated_length(generation_config=gc, has_default_max_length=has_default_max_length,
                                         has_default_min_length=has_default_min_length,
                                         model_input_name="input_ids", inputs_tensor=input_ids, input_ids_length=P)
    model._validate_generated_length(gc, P, has_default_max_length)  # raises for no room, as generate() does

    processors = model._get_logits_processor(
        generation_config=gc, input_ids_seq_length=P, encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(), device=input_ids.device,
        model_kwargs={"attention_mask": mask}, negative_prompt_ids=None, negative_prompt_attention_mask=None)
    temperature, top_k = 1.0, None
    for p in processors:
        if type(p) is TemperatureLogitsWarper:
            temperature = float(p.temperature)
        elif type(p) is TopKLogitsWarper and p.filter_value == -float("inf"):
            top_k = int(p.top_k)
        else:
            return None, f"logits processor {type(p).__name__}"
    criteria = model._get_stopping_criteria(generation_config=gc, stopping_criteria=StoppingCriteriaList(),
                                            tokenizer=tokenizer)
    for c in criteria:
        if type(c) not in (MaxLengthCriteria, EosTokenCriteria):
            return None, f"stopping criterion {type(c).__name__}"
    eos = gc._eos_token_tensor
    if eos is not None:
        if eos.numel() > 1:
            return None, f"several EOS ids {eos.tolist()}"
        eos = int(eos.reshape(-1)[0])
        if eos < 0:
            return None, f"eos_token_id={eos}"
    pad = gc._pad_token_tensor
    new = int(gc.max_length) - P
    plan = {"input_ids": input_ids, "max_new_tokens": new, "eos_token_id": eos,
            "pad_token_id": None if pad is None else int(pad), "do_sample": mode == GenerationMode.SAMPLE}
    if plan["do_sample"]:
        plan.update(temperature=temperature, top_k=top_k)
    # transformers' loop asks whether to compile its forward (a HybridCache is not compileable: never) and warns
    # once when compile_config asks for it
    model._valid_auto_compile_criteria({}, gc)
    return plan, ""


def say_why(reason: str) -> None:
    """Log, once per reason, why a CUDA ``generate()`` call took transformers' loop."""
    if reason and reason not in _SAID:
        _SAID.add(reason)
        logger.warning("generate(): transformers' eager loop, not the CUDA-graph fast path: %s "
                       "(said once per reason)", reason)
