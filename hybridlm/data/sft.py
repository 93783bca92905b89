"""Chat-formatted SFT examples and resumable, rank-sharded, padded batches of them (KD-SFT, DPO).

Records (a ``.json`` list, JSON lines, or ``.jsonl``; one file may mix layouts, detected per record):

1. alpaca: ``{"instruction", "input", "output"}`` (+ optional ``"system"`` string and ``"history"``
   ``[[user, assistant], ...]`` of earlier turns) -> user = instruction, plus ``"\\n" + input`` when the
   input is not empty (LLaMA-Factory's joining); assistant = output;
2. ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``;
3. ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": str}, ...]}`` (+ optional
   top-level ``"system"``).

Rendering is :mod:`hybridlm.data.chat`'s (one implementation for SFT and DPO): the tokenizer's chat
template when it has one, else the plain ``"User: …\\nAssistant: …"`` fallback template with the tokenizer's eos
after the final answer. A single-turn SFT example therefore tokenizes exactly like a DPO chosen sequence.

Labels are aligned with ``input_ids`` (transformers convention; the loss shifts them) and are -100
everywhere except on the assistant turns (every assistant turn of a multi-turn conversation trains; with a
chat template the turn's closing tokens, e.g. ``<|im_end|>``, train too so that the model learns to stop).
Turn boundaries are found as in ``tokenize_pair``: the conversation is tokenized as one string and a turn
starts where the tokens of the prompt rendered up to it stop matching (a token merging across the boundary
belongs to the answer). Sequences are cut to ``max_length`` from the right; an example left with no
assistant token is dropped (counted in the load summary).

Scale: every rank reads and tokenizes the whole file at start-up and keeps it in memory as int32 arrays
(seconds for the demo sets; fine up to a few hundred thousand conversations). A multi-billion-token SFT mix
would want pre-tokenized shards like :mod:`hybridlm.data.packed`'s.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting
from hybridlm.data.chat import (RecordError, chat_messages, closing_ids, common_prefix_len, render_chat, render_prompt,
                                sharegpt_turn, token_ids)
from hybridlm.data.assets import resolve_source
from hybridlm.data.prepare import _json_records, _split_docs
from hybridlm.data.sampler import ShuffledBatches, validation_indices

IGNORE_INDEX = -100
Messages = List[Dict[str, str]]


# ------------------------------------------------------------------------------------- records
def _text(rec: Dict[str, Any], key: str, required: bool = True) -> str:
    if key not in rec or (rec[key] is None and not required):
        if required:
            raise RecordError(f"missing field {key!r}")
        return ""
    v = rec[key]
    if not isinstance(v, str):
        raise RecordError(f"{key}: expected a string, got {type(v).__name__}")
    return v


def _with_system(messages: Messages, system: Any) -> Messages:
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise RecordError(f"system: expected a string, got {type(system).__name__}")
    if messages and messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}] + messages


def _normalize_conversation(rec: Any) -> Messages:
    if not isinstance(rec, dict):
        raise RecordError(f"expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        messages = chat_messages(rec["messages"], "messages")
    elif "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list):
            raise RecordError("conversations: expected a list of {from, value} turns")
        messages = [sharegpt_turn(t, f"conversations[{i}]") for i, t in enumerate(conv)]
    elif "instruction" in rec:
        user = _text(rec, "instruction")
        extra = _text(rec, "input", required=False)
        if extra:
            user = f"{user}\n{extra}" if user else extra
        messages = []
        history = rec.get("history") or []
        if not isinstance(history, list):
            raise RecordError("history: expected a list of [user, assistant] pairs")
        for i, turn in enumerate(history):
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
                raise RecordError(f"history[{i}]: expected a [user, assistant] pair of strings")
            messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": _text(rec, "output")}]
    else:
        raise RecordError("expected alpaca instruction/input/output, a 'messages' list, or ShareGPT "
                           "'conversations'")
    messages = _with_system(messages, rec.get("system"))
    while messages and messages[-1]["role"] != "assistant":  # nothing to learn after the last answer
        messages = messages[:-1]
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant turn to train on")
    if messages[0]["role"] == "assistant":
        raise RecordError("the conversation must not start with an assistant turn")
    return messages


def normalize_conversation(rec: Any) -> Messages:
    """One record of any accepted layout -> a list of ``{role, content}`` messages ending with the assistant."""
    try:
        return _normalize_conversation(rec)
    except RecordError as e:
        raise ConfigError(str(e)) from None


def load_sft_data(path) -> List[Messages]:
    """Every conversation of a ``.json`` / ``.jsonl`` SFT file or ``asset:<record set>`` (ConfigError naming the
    file and record)."""
    p = Path(resolve_source(str(path))).expanduser()
    if not p.is_file():
        raise ConfigError(f"{p}: SFT data file not found (expected a .json or .jsonl file)")
    out = []
    for i, rec in enumerate(_json_records(p)):
        try:
            out.append(_normalize_conversation(rec))
        except RecordError as e:
            raise ConfigError(f"{p}: record {i}: {e}") from None
    if not out:
        raise ConfigError(f"{p}: no SFT records")
    return out


# ------------------------------------------------------------------------------------- tokenizing
def tokenize_conversation(tokenizer, messages: Messages, max_length: int) -> Optional[Dict[str, List[int]]]:
    """``{"input_ids", "labels"}`` of one conversation (labels -100 off the assistant turns), cut to
    ``max_length``; None when no assistant token survives the cut."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"max_length: expected an integer >= 2, got {max_length!r}")
    last = len(messages) - 1
    full = token_ids(tokenizer, render_chat(tokenizer, messages)) + closing_ids(tokenizer)
    labels = [IGNORE_INDEX] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = common_prefix_len(token_ids(tokenizer, render_prompt(tokenizer, messages[:k])), full)
        if k == last:
            end = len(full)
        else:  # where the conversation up to this answer stops matching
            end = common_prefix_len(token_ids(tokenizer, render_chat(tokenizer, messages[:k + 1])), full)
        labels[start:end] = full[start:end]
    ids, labels = full[:max_length], labels[:max_length]
    if all(l == IGNORE_INDEX for l in labels[1:]):  # label 0 is never a target (nothing predicts it)
        return None
    return {"input_ids": ids, "labels": labels}


def collate_sft(examples: Sequence[Dict[str, Sequence[int]]], pad_id: int) -> Dict[str, torch.Tensor]:
    """Examples (int lists or arrays) as right-padded ``input_ids``, ``labels`` (-100 on pads) and
    ``attention_mask``, each ``(B, T_max)``. Causal models never let a real token see the pads after it, so the
    mask is informational."""
    T = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[i, :n] = torch.as_tensor(np.asarray(e["input_ids"]), dtype=torch.long)
        labels[i, :n] = torch.as_tensor(np.asarray(e["labels"]), dtype=torch.long)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def pad_token_id(tokenizer) -> int:
    for key in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, key, None)
        if v is not None:
            return int(v)
    return 0


# ------------------------------------------------------------------------------------- batching


def fingerprint(examples: Sequence[Any]) -> str:
    """A short hash of tokenized examples (dicts of int lists, or nested lists), to refuse resuming on other data."""
    h = hashlib.sha1()
    for e in examples:
        items = sorted(e.items()) if isinstance(e, dict) else [("", e)]
        for k, v in items:
            h.update(str(k).encode())
            if isinstance(v, (list, tuple, np.ndarray)):
                h.update(np.asarray(v, dtype=np.int64).tobytes())
            else:
                h.update(repr(v).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


class ExampleBatches(ShuffledBatches):
    """Endless, resumable, rank-sharded micro-batches of a fixed list of examples (collated by ``collate``),
    served by the shared shuffle / shard / resume policy of :class:`~hybridlm.data.sampler.ShuffledBatches`;
    the saved state also carries a fingerprint of the examples so a resume on other data is refused."""

    resume_hint = "resume with the same data file, max_length, tokenizer and seed"

    def __init__(self, examples: Sequence[Any], micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, collate: Callable[[List[Any]], Dict[str, torch.Tensor]] = list, name: str = "data"):
        self.examples, self.collate = list(examples), collate
        self.num_examples = len(self.examples)
        super().__init__(self.num_examples, micro_batch_size, rank, world_size, seed,
                         too_few=f"{name}: {self.num_examples} training examples")
        self._fingerprint: Optional[str] = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.examples)
        return self._fingerprint

    def make_batch(self, indices: np.ndarray) -> Dict[str, torch.Tensor]:
        return self.collate([self.examples[int(i)] for i in indices])

    def identity(self) -> Dict[str, Any]:
        return {"seed": self.seed, "num_examples": self.num_examples, "fingerprint": self.fingerprint}


class SFTBatches(ExampleBatches):
    """:class:`ExampleBatches` of tokenized SFT examples, collated by :func:`collate_sft`."""

    def __init__(self, examples: Sequence[Dict[str, List[int]]], micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, pad_id: int = 0):
        super().__init__(examples, micro_batch_size, rank, world_size, seed, partial(collate_sft, pad_id=pad_id),
                         name="sft data")


def validation_example_batches(examples: Sequence[Any], micro_batch_size: int, max_batches: int, rank: int = 0,
                               world_size: int = 1, collate: Callable = list,
                               name: str = "validation data") -> List[Dict[str, torch.Tensor]]:
    """At most ``max_batches`` batches of the leading examples (:func:`validation_indices`), collated."""
    plan = validation_indices(len(examples), micro_batch_size, max_batches, rank, world_size,
                              f"{name}: {len(examples)} validation examples, fewer than one per rank ({world_size}); "
                              f"raise val_fraction")
    return [collate([examples[i] for i in idx]) for idx in plan]


def sft_validation_batches(examples: Sequence[Dict[str, List[int]]], micro_batch_size: int, max_batches: int,
                           rank: int = 0, world_size: int = 1, pad_id: int = 0) -> List[Dict[str, torch.Tensor]]:
    return validation_example_batches(examples, micro_batch_size, max_batches, rank, world_size,
                                      partial(collate_sft, pad_id=pad_id), name="sft validation data")


# ------------------------------------------------------------------------------------- config
@dataclass
class SFTDataConfig(Section):
    """The ``data:`` section of a KD-SFT stage: a chat / alpaca ``.json`` / ``.jsonl`` file, tokenized on load
    with the teacher's tokenizer. ``val_fraction`` of the records (a seeded, record-level split) validate.
    DPO's section (``distill.dpo_stage.PreferenceDataConfig``) extends it."""

    path: str = setting("", nonempty="a .json / .jsonl file")
    max_length: int = setting(2048, ge=2)
    val_fraction: float = setting(0.05, gt=0, lt=1)
    val_max_batches: int = setting(20, ge=1)
    seed: int = setting(1234, ge=0)  # train/val split and per-epoch shuffling


def split_records(n: int, val_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(train indices, val indices): the packed-data split (``prepare``'s, a seeded permutation)."""
    if n < 2:
        raise ConfigError(f"data: {n} record(s), need at least 2 (one for training, one for validation)")
    split = _split_docs(np.zeros(n, dtype=np.int64), float(val_fraction), seed)  # one source
    return split["train"], split["val"]


def make_sft_batches(data_cfg: SFTDataConfig, optim, dist, tokenizer):
    """``run_stage``'s ``make_batches``: (:class:`SFTBatches`, validation batch list) of ``data_cfg.path``."""
    conversations = load_sft_data(data_cfg.path)
    train_idx, val_idx = split_records(len(conversations), data_cfg.val_fraction, data_cfg.seed)
    parts, dropped = {}, 0
    for split, idx in (("train", train_idx), ("val", val_idx)):
        tokenized = [tokenize_conversation(tokenizer, conversations[int(i)], data_cfg.max_length) for i in idx]
        dropped += sum(t is None for t in tokenized)
        # int32 arrays: ~8 bytes a token in memory instead of ~70 for python lists
        parts[split] = [{k: np.asarray(v, dtype=np.int32) for k, v in t.items()} for t in tokenized if t is not None]
    pad = pad_token_id(tokenizer)
    train = SFTBatches(parts["train"], optim.micro_batch_size, dist.rank, dist.world_size, data_cfg.seed, pad)
    val = sft_validation_batches(parts["val"], optim.micro_batch_size, data_cfg.val_max_batches, dist.rank,
                                 dist.world_size, pad)
    if dist.rank == 0:
        sup = sum(int((e["labels"][1:] != IGNORE_INDEX).sum()) for e in parts["train"])
        tot = sum(len(e["input_ids"]) for e in parts["train"])
        print(f"sft data {data_cfg.path}: {len(parts['train'])} train / {len(parts['val'])} val examples "
              f"({dropped} dropped: no answer token within max_length {data_cfg.max_length}); "
              f"train tokens {tot}, {sup} of them supervised", flush=True)
    return train, val
