"""RULER-style long-context tasks built offline from local text, scored on any causal LM (``hybrid-eval ruler``).

:mod:`.haystack` reads the haystack text, :mod:`.tasks` builds the items at a length in the model's tokens,
:mod:`.score` predicts, scores and writes the table and plot; :func:`evaluate_model` ties them together for one
model (the CLI and the route report call it).
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Sequence

from hybridlm.eval.ruler.haystack import DEFAULT_HAYSTACK, Haystack, load_haystack
from hybridlm.eval.ruler.score import GreedyPredictor, score_items, string_match_all, write_ruler_outputs
from hybridlm.eval.ruler.tasks import TASKS, PromptRenderer, RulerItem, build_items, resolve_tasks

CHAT_MODES = ("auto", "on", "off")
DEFAULT_LENGTHS = (4096, 8192)


def use_chat(tokenizer, mode: str) -> bool:
    """``auto``: the chat template when the tokenizer has one (an instruct teacher and its hybrids)."""
    return mode == "on" or (mode == "auto" and bool(getattr(tokenizer, "chat_template", None)))


def evaluate_model(model, tokenizer, label: str, tasks: Sequence[str], lengths: Sequence[int], items: int,
                   hay: Haystack, seed: int = 0, chat: str = "auto", progress: bool = True) -> Dict[str, Any]:
    """One model's scores on ``items`` items of every task at every length (items built with its tokenizer)."""
    chat_on = use_chat(tokenizer, chat)
    built = build_items(tasks, lengths, items, hay, PromptRenderer(tokenizer, chat_on), seed)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if progress and limit and max(lengths) > limit:
        print(f"warning: {label}: {max(lengths)} tokens is beyond its max_position_embeddings ({limit})",
              file=sys.stderr)
    out = score_items(built, GreedyPredictor(model, tokenizer), label, progress=progress)
    return {"label": label, "chat_template": chat_on, **out}


def ruler_result(models: List[Dict[str, Any]], tasks: Sequence[str], lengths: Sequence[int], items: int,
                 hay: Haystack, seed: int) -> Dict[str, Any]:
    return {"command": "ruler", "tasks": list(tasks), "lengths": [int(L) for L in lengths], "items": items,
            "haystack": hay.source, "seed": seed, "models": models}


__all__ = ["CHAT_MODES", "DEFAULT_HAYSTACK", "DEFAULT_LENGTHS", "TASKS", "GreedyPredictor", "Haystack", "RulerItem",
           "build_items", "evaluate_model", "load_haystack", "resolve_tasks", "ruler_result", "score_items",
           "string_match_all", "use_chat", "write_ruler_outputs"]
