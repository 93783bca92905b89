"""Generation-scored evaluation: greedy continuations of held-out prompts, scored against the teacher.

Perplexity and log-likelihood cloze score a model on given text; a model can do well there and still generate
badly (loops, drift). Here every model generates; the teacher only judges. For ``N`` held-out prompts (the first
``prompt_tokens`` tokens of the first ``N`` documents of ``asset:c4_demo`` that have more tokens than that; C4 web
text, which no stage of the shipped route configs trains on: :func:`training_sources`), each model writes a greedy
continuation of exactly ``new_tokens`` tokens (argmax at every step, no sampling, eos not treated specially, no
KV cache: every step runs the whole sequence, the same code for the teacher and the hybrids). Per model:

* ``gen_ppl``: the teacher's perplexity of the model's continuations, ``exp`` of the teacher's mean next-token
  NLL over all continuation tokens of all prompts (each given its prompt and the continuation so far);
  ``gen_ppl_ratio``: that divided by the teacher's perplexity of its own greedy continuations (1.0 for the
  teacher; above 1 the model writes what the teacher finds less likely);
* ``gen_repeat4``: the repeated 4-gram rate, over all continuations together: of the ``new_tokens - 3`` token
  4-grams of a continuation (positions ``0..new_tokens-4``), the fraction equal to a 4-gram that starts at an
  earlier position of the same continuation (the prompt is not counted); 0 for no repetition, near 1 for a loop;
* ``gen_agree``: the mean over prompts of the number of leading continuation tokens equal to the teacher's greedy
  continuation (tokens before the first difference; ``new_tokens`` for the teacher itself).

A low ``gen_ppl`` alone can hide a loop (repeated text is easy to predict), hence the repeat rate beside it.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.data.chat import common_prefix_len
from hybridlm.data.record_sets import record_file

PROMPT_SOURCE = "asset:c4_demo"
NGRAM = 4


def source_prompts(tokenizer, texts: Iterable[str], n: int, prompt_tokens: int) -> torch.Tensor:
    """``(n, prompt_tokens)`` ids: the first ``prompt_tokens`` tokens (no special tokens) of the first ``n`` texts
    that have more tokens than that."""
    for name, v in (("report.generation_prompts", n), ("report.generation_prompt_tokens", prompt_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}: expected a positive integer, got {v!r}")
    rows: List[List[int]] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > prompt_tokens:
            rows.append(ids[:prompt_tokens])
            if len(rows) == n:
                return torch.tensor(rows, dtype=torch.long)
    raise ConfigError(f"report.generation_prompts: only {len(rows)} held-out documents have more than "
                      f"{prompt_tokens} tokens, {n} asked for")


def heldout_prompts(tokenizer, n: int, prompt_tokens: int = 32) -> torch.Tensor:
    """The report's held-out prompts: :func:`source_prompts` of the documents of :data:`PROMPT_SOURCE`, in file
    order."""
    path = record_file(PROMPT_SOURCE.split(":", 1)[1])
    texts = (json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return source_prompts(tokenizer, texts, n, prompt_tokens)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int = 8) -> torch.Tensor:
    """``(N, new_tokens)``: each row the argmax continuation of its prompt (every step a full forward pass)."""
    out = []
    for i in range(0, prompts.shape[0], batch_size):
        ids = prompts[i:i + batch_size].to(_device(model))
        start = ids.shape[1]
        for _ in range(new_tokens):
            nxt = model(input_ids=ids).logits[:, -1].float().argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        out.append(ids[:, start:].cpu())
    return torch.cat(out)


@torch.no_grad()
def continuation_nll(teacher, prompts: torch.Tensor, conts: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """``(N, L)``: the teacher's NLL (nats) of each continuation token given its prompt and the tokens before it."""
    out = []
    P = prompts.shape[1]
    for i in range(0, prompts.shape[0], batch_size):
        ids = torch.cat([prompts[i:i + batch_size], conts[i:i + batch_size]], dim=1).to(_device(teacher))
        logp = torch.log_softmax(teacher(input_ids=ids).logits[:, P - 1:-1].float(), dim=-1)
        out.append(-logp.gather(-1, ids[:, P:, None])[..., 0].cpu())
    return torch.cat(out)


def repeated_ngrams(seq: Sequence[int], n: int = NGRAM) -> tuple:
    """``(repeated, total)``: of the ``len(seq) - n + 1`` n-grams of ``seq``, how many equal an n-gram starting at an
    earlier position of ``seq``."""
    seen, repeated, total = set(), 0, 0
    for i in range(len(seq) - n + 1):
        g = tuple(seq[i:i + n])
        repeated += g in seen
        seen.add(g)
        total += 1
    return repeated, total


def leading_agreement(seq: Sequence[int], ref: Sequence[int]) -> int:
    """Leading tokens of ``seq`` equal to ``ref`` (the index of the first difference)."""
    return common_prefix_len(seq, ref)


def score_continuations(teacher, prompts: torch.Tensor, conts: torch.Tensor, teacher_conts: torch.Tensor,
                        teacher_nll: Optional[float] = None, batch_size: int = 8) -> Dict[str, float]:
    """The module docstring's metrics of ``conts`` (one model's continuations of ``prompts``); ``teacher_nll`` is
    the teacher's mean NLL of ``teacher_conts`` (computed when not given)."""
    nll = float(continuation_nll(teacher, prompts, conts, batch_size).double().mean())
    if teacher_nll is None:
        teacher_nll = float(continuation_nll(teacher, prompts, teacher_conts, batch_size).double().mean())
    rep = [repeated_ngrams(c.tolist()) for c in conts]
    agree = [leading_agreement(c.tolist(), r.tolist()) for c, r in zip(conts, teacher_conts)]
    return {"gen_ppl": math.exp(min(nll, 50.0)), "gen_ppl_ratio": math.exp(min(nll - teacher_nll, 50.0)),
            f"gen_repeat{NGRAM}": sum(r for r, _ in rep) / max(sum(t for _, t in rep), 1),
            "gen_agree": sum(agree) / len(agree)}


class GenerationScorer:
    """Scores model after model against one teacher: the teacher's greedy continuations are made once."""

    def __init__(self, teacher, prompts: torch.Tensor, new_tokens: int = 64, batch_size: int = 8):
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < NGRAM:
            raise ConfigError(f"report.generation_tokens: expected at least {NGRAM}, got {new_tokens}")
        self.teacher, self.prompts, self.new_tokens, self.batch_size = teacher, prompts, new_tokens, batch_size
        self.teacher_conts = greedy_continuations(teacher, prompts, new_tokens, batch_size)
        self.teacher_nll = float(continuation_nll(teacher, prompts, self.teacher_conts, batch_size).double().mean())

    def __call__(self, model) -> Dict[str, float]:
        conts = (self.teacher_conts if model is self.teacher
                 else greedy_continuations(model, self.prompts, self.new_tokens, self.batch_size))
        return score_continuations(self.teacher, self.prompts, conts, self.teacher_conts, self.teacher_nll,
                                   self.batch_size)


# ----------------------------------------------------------------------------- held-out check


def _source_specs(section: Any) -> List[str]:
    """Source specs of one data section: ``sources`` entries (strings or ``{source: ...}``) and ``path``."""
    if not isinstance(section, dict):
        return []
    specs = []
    for entry in section.get("sources") or []:
        specs.append(entry["source"] if isinstance(entry, dict) else entry)
    if isinstance(section.get("path"), str):
        specs.append(section["path"])
    return [str(s) for s in specs]


def training_sources(cfg: Dict[str, Any]) -> List[str]:
    """Every data source a route config (``ild`` / ``kd`` / ``dpo`` sections) or a stage config (``data``) trains
    on, and ``init.calib_sources``: ``asset:`` names, files and packed-data directories as written."""
    specs: List[str] = _source_specs(cfg.get("data"))
    for stage in ("ild", "kd", "long_context", "dpo"):
        specs += _source_specs((cfg.get(stage) or {}).get("data"))
    specs += [str(s) for s in ((cfg.get("init") or {}).get("calib_sources") or [])]
    return list(dict.fromkeys(specs))


def check_prompt_source_heldout(cfg: Dict[str, Any]) -> None:
    """ConfigError when the route trains on :data:`PROMPT_SOURCE` (its prompts would not be held out)."""
    if PROMPT_SOURCE in training_sources(cfg):
        raise ConfigError(f"report.generation_prompts: the prompts come from {PROMPT_SOURCE}, which this route "
                          f"trains on; they would not be held out")
