"""Perplexity of any causal LM (a transformers Llama teacher or a hybrid) on held-out text."""
from __future__ import annotations

import math
from typing import Dict, Iterable, List

import torch
import torch.nn.functional as F


def token_windows(tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int) -> List[torch.Tensor]:
    """Consecutive non-overlapping windows of ``seq_len + 1`` tokens (EOS between texts), up to ``max_tokens``."""
    ids: List[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        if len(ids) >= max_tokens + seq_len + 1:
            break
    n = min(len(ids) - 1, max_tokens) // seq_len
    return [torch.tensor(ids[i * seq_len: (i + 1) * seq_len + 1]) for i in range(n)]


@torch.no_grad()
def perplexity(model, windows: List[torch.Tensor], batch_size: int = 4) -> Dict[str, float]:
    """Token-mean next-token NLL and its exponent over the windows."""
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = torch.stack(windows[i:i + batch_size]).to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    loss = nll / max(count, 1)
    return {"nll": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}
