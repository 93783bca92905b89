"""Perplexity of any causal LM (a transformers Llama teacher or a hybrid) on held-out text."""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F


def token_stream(tokenizer, texts: Iterable[str], limit: Optional[int] = None) -> List[int]:
    """Token ids of the texts, each followed by EOS, no other special tokens; stops once ``limit`` ids are read."""
    ids: List[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        if limit is not None and len(ids) >= limit:
            break
    return ids


def windows_from_ids(ids: List[int], seq_len: int, max_tokens: int) -> List[torch.Tensor]:
    """Consecutive non-overlapping windows of ``seq_len + 1`` ids (``seq_len`` targets each), up to ``max_tokens`` targets."""
    n = min(len(ids) - 1, max_tokens) // seq_len
    return [torch.tensor(ids[i * seq_len: (i + 1) * seq_len + 1]) for i in range(n)]


def token_windows(tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int) -> List[torch.Tensor]:
    """Consecutive non-overlapping windows of ``seq_len + 1`` tokens (EOS between texts), up to ``max_tokens``."""
    return windows_from_ids(token_stream(tokenizer, texts, max_tokens + seq_len + 1), seq_len, max_tokens)


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
