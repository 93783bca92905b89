"""Multiple-choice accuracy by log-likelihood, scored the way lm-evaluation-harness scores ``multiple_choice``
tasks, for places that run without the harness (the upcycling route's report on a GPU machine).

Per item: the log-likelihood of each continuation ``" " + choice`` after ``context`` (tokens of the
continuation = tokens of ``context + " " + choice`` past those of ``context``, no special tokens, as the
harness's ``hf`` model encodes a pair); ``acc`` takes the argmax, ``acc_norm`` the argmax of the
log-likelihood divided by the choice's length in characters. ``tests/test_eval.py`` checks both against the
harness on the same items.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F


def encode_pair(tokenizer, context: str, continuation: str):
    """(context ids, continuation ids), split as the harness splits them (trailing spaces move right)."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    whole = tokenizer(stripped + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(stripped, add_special_tokens=False)["input_ids"]
    return whole[:len(ctx)], whole[len(ctx):]


@torch.no_grad()
def continuation_logprobs(model, pairs: Sequence[tuple], batch_size: int = 32) -> List[float]:
    """Summed log-probability of each pair's continuation ids given its context ids."""
    device = next(model.parameters()).device
    out: List[float] = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        seqs = [list(ctx) + list(cont) for ctx, cont in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, :len(seq)] = torch.tensor(seq)  # right padding: causal, so it never reaches a scored token
        logits = model(input_ids=ids.to(device)).logits.float()
        logp = F.log_softmax(logits, dim=-1)
        for row, (ctx, cont) in enumerate(chunk):
            pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1, device=device)
            target = torch.tensor(cont, device=device)
            out.append(float(logp[row, pos, target].sum()))
    return out


def multiple_choice_accuracy(model, tokenizer, items: Sequence[Dict], batch_size: int = 32) -> Dict[str, float]:
    """``acc`` and ``acc_norm`` over ``items`` (``{"context", "choices", "label"}`` each)."""
    pairs = []
    for item in items:
        for choice in item["choices"]:
            pairs.append(encode_pair(tokenizer, item["context"], " " + choice))
    lls = continuation_logprobs(model, pairs, batch_size)
    acc = acc_norm = 0
    k = 0
    for item in items:
        n = len(item["choices"])
        ll = lls[k:k + n]
        k += n
        norm = [v / len(c) for v, c in zip(ll, item["choices"])]
        acc += int(max(range(n), key=ll.__getitem__) == item["label"])
        acc_norm += int(max(range(n), key=norm.__getitem__) == item["label"])
    return {"acc": acc / len(items), "acc_norm": acc_norm / len(items), "items": len(items)}
