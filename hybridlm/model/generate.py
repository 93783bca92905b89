"""Greedy sampling by repeated full forwards (no cache): small, exact, used for end-of-run samples and
as the reference the cached path is tested against.

For real generation use ``model.generate(input_ids, attention_mask=..., max_new_tokens=...)``: it carries a
:class:`hybridlm.model.cache.HybridCache` (MLA latents + RoPE keys, recurrent and conv states), decodes one token
per step (absorbed-weight MLA, recurrent mixer steps) and handles left-padded batches; on CUDA, rows of one
length go through a static cache and a captured step (:mod:`hybridlm.model.fast_generate`)."""
from __future__ import annotations

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
