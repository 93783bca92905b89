"""Greedy sampling by repeated full forwards (no cache): small, exact, used for end-of-run samples and
as the reference the cached path is tested against.

For real generation use ``model.generate(input_ids, attention_mask=..., max_new_tokens=...)``: it carries a
:class:`hybridlm.model.cache.HybridCache` (MLA latents + RoPE keys, recurrent and conv states), decodes one token
per step (absorbed-weight MLA, recurrent mixer steps) and handles left-padded batches; on CUDA, rows of one
length go through a static cache and a captured step (:mod:`hybridlm.model.fast_generate`).

Exports call :func:`set_generation_defaults` before ``save_pretrained`` and save the tokenizer with
:func:`save_tokenizer` (left padding, a pad token), so that a saved folder generates sensibly in transformers."""
from __future__ import annotations

import copy
from typing import Optional

import torch


@torch.no_grad()
def greedy_generate(model, input_ids: torch.LongTensor, max_new_tokens: int, eos_token_id=None) -> torch.LongTensor:
    was_training = model.training
    model.eval()
    ids = input_ids
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        if eos_token_id is not None and bool((nxt == eos_token_id).all()):
            break
    model.train(was_training)
    return ids


def _pad_id(tokenizer) -> Optional[int]:
    """The tokenizer's pad id, else its EOS id (what an exported tokenizer without a pad token pads with)."""
    if tokenizer is None:
        return None
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def set_generation_defaults(model, tokenizer=None) -> None:
    """Before exporting ``model`` (with ``tokenizer``): the special tokens and generation defaults that make
    transformers' ``generate()`` and ``pipeline("text-generation")`` behave for a base or chat model.

    ``config`` and ``generation_config`` get ``pad_token_id`` (the tokenizer's pad, else its EOS),
    ``bos_token_id`` / ``eos_token_id`` where unset (the tokenizer's), and ``generation_config.do_sample=False``
    where unset: greedy unless a call asks for sampling (the text-generation pipeline samples with temperature 0.7
    when the saved generation config leaves ``do_sample`` unset). Settings already made are kept."""
    config, gc = model.config, model.generation_config
    pad = _pad_id(tokenizer)
    for key, value in (("pad_token_id", pad),
                       ("bos_token_id", getattr(tokenizer, "bos_token_id", None)),
                       ("eos_token_id", getattr(tokenizer, "eos_token_id", None))):
        if getattr(config, key, None) is None and value is not None:
            setattr(config, key, value)
        if getattr(gc, key, None) is None and getattr(config, key, None) is not None:
            setattr(gc, key, getattr(config, key))
    if gc.do_sample is None:
        gc.do_sample = False
    gc._from_model_config = False  # set on purpose: loaded as it is, not rebuilt from config.json


def save_tokenizer(tokenizer, directory) -> None:
    """Save ``tokenizer`` for a decoder-only model: padding on the left (a right-padded batch generates from its
    pads) and a pad token (its EOS when it has none). The caller's tokenizer is not changed."""
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    tok.init_kwargs["padding_side"] = "left"  # what save_pretrained writes to tokenizer_config.json
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.save_pretrained(str(directory))
