"""Scoring the RULER-style tasks: greedy answers, RULER's string match, and the result table and plot.

A *predictor* maps an item (:class:`hybridlm.eval.ruler.tasks.RulerItem`) to the model's answer text; the one a
model gives is :class:`GreedyPredictor` (greedy ``generate`` of up to the task's budget after the prompt, stopping
at EOS). An item scores RULER's ``string_match_all``: the fraction of its expected answers found, case-insensitive,
as substrings of the output (control characters turned into line breaks, ends stripped). A task's score at a length
is the mean over its items, in [0, 1]; the Markdown table shows it in percent, as RULER reports.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch

from hybridlm.eval.ruler.tasks import RulerItem
from hybridlm.utils.atomic import atomic_write_text, save_figure, write_json

Predictor = Callable[[RulerItem], str]
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(text: str) -> str:
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` that occur in ``prediction`` (case-insensitive)."""
    pred = postprocess(prediction).lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


class GreedyPredictor:
    """The model's greedy continuation of an item's prompt, up to ``item.tokens_to_generate`` tokens or EOS."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        eos = tokenizer.eos_token_id
        self.settings = {"do_sample": False, "eos_token_id": eos,
                         "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos}
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, item: RulerItem) -> str:
        ids = torch.tensor([item.input_ids], device=self.device)
        from transformers import GenerationConfig
        config = GenerationConfig(max_new_tokens=item.tokens_to_generate, **self.settings)  # no sampling defaults
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return self.tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def score_items(items: Sequence[RulerItem], predict: Predictor, label: str = "", progress: bool = True
                ) -> Dict[str, Any]:
    """Every item predicted and scored: ``{"scores": {task: {length: mean}}, "average": {length: mean over tasks},
    "samples": [...]}``; with ``progress``, one stderr line per task and length."""
    samples: List[Dict[str, Any]] = []
    groups: Dict[tuple, List[float]] = {}
    t0 = time.perf_counter()
    for n, item in enumerate(items):
        pred = predict(item)
        s = string_match_all(pred, item.answers)
        samples.append({"task": item.task, "length": item.length, "index": item.index, "tokens": item.tokens,
                        "answers": item.answers, "prediction": pred, "score": s})
        key = (item.task, item.length)
        groups.setdefault(key, []).append(s)
        last = n + 1 == len(items) or (items[n + 1].task, items[n + 1].length) != key
        if progress and last:
            vals = groups[key]
            print(f"ruler: {label + ' ' if label else ''}{item.task} @ {item.length}: {sum(vals) / len(vals):.3f} "
                  f"over {len(vals)} items ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    scores: Dict[str, Dict[str, float]] = {}
    for (task, length), vals in groups.items():
        scores.setdefault(task, {})[str(length)] = sum(vals) / len(vals)
    lengths = sorted({L for _, L in groups}, key=int)
    average = {str(L): sum(scores[t][str(L)] for t in scores) / len(scores) for L in lengths}
    return {"scores": scores, "average": average, "samples": samples,
            "seconds": round(time.perf_counter() - t0, 2)}


# ----------------------------------------------------------------------------------------- outputs
def ruler_markdown(result: Dict[str, Any]) -> str:
    """One table per model: a row per task, a column per length, scores in percent; the mean over tasks last."""
    lengths = [str(L) for L in result["lengths"]]
    lines = [f"RULER-style tasks, {result['items']} items per task and length, haystack {result['haystack']}, "
             f"seed {result['seed']}; score = percent of expected answers found in the greedy output "
             f"(string_match_all).", ""]
    models = result["models"]
    lines += ["| task | " + " | ".join(f"{m['label']} @ {L}" for m in models for L in lengths) + " |",
              "|---|" + "---|" * (len(models) * len(lengths))]
    for task in result["tasks"]:
        cells = [f"{100 * m['scores'][task][L]:.1f}" for m in models for L in lengths]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines.append("| **mean** | " + " | ".join(f"**{100 * m['average'][L]:.1f}**" for m in models for L in lengths)
                 + " |")
    return "\n".join(lines) + "\n"


def plot_ruler(result: Dict[str, Any], png) -> None:
    """Mean score over tasks against context length, a line per model (teacher beside hybrid), and a panel of the
    per-task scores at each length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [int(L) for L in result["lengths"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for m in result["models"]:
        ax.plot(lengths, [100 * m["average"][str(L)] for L in lengths], "o-", label=m["label"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{L:,}" for L in lengths])
    ax.set_ylim(-2, 102)
    ax.set_xlabel("context length (tokens of the model's tokenizer)")
    ax.set_ylabel("mean score over tasks (%)")
    ax.set_title(f"RULER-style tasks ({len(result['tasks'])}), haystack {result['haystack']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    tasks, n_series = result["tasks"], len(result["models"]) * len(lengths)
    width = 0.8 / n_series
    k = 0
    for m in result["models"]:
        for L in lengths:
            bx.bar([i + k * width for i in range(len(tasks))], [100 * m["scores"][t][str(L)] for t in tasks], width,
                   label=f"{m['label']} @ {L:,}")
            k += 1
    bx.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=45, ha="right", fontsize=7)
    bx.set_ylim(0, 102)
    bx.set_ylabel("score (%)")
    bx.set_title(f"per task, {result['items']} items each", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, png, dpi=120)


def write_ruler_outputs(result: Dict[str, Any], json_path) -> Dict[str, str]:
    """``json_path`` and, beside it with the same stem, the Markdown table and the PNG (each written atomically)."""
    p = Path(json_path)
    md, png = p.with_suffix(".md"), p.with_suffix(".png")
    write_json(p, result)
    atomic_write_text(str(md), ruler_markdown(result))
    plot_ruler(result, png)
    return {"json": str(p), "markdown": str(md), "png": str(png)}
