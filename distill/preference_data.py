"""Preference pairs for DPO: loading three JSON / JSONL layouts and tokenizing a pair.

Every record is normalised to a :class:`PreferencePair` ``(prompt_messages, chosen, rejected)``:
``prompt_messages`` is a list of ``{"role": "system" | "user" | "assistant", "content": str}`` (the
conversation before the answer), ``chosen`` / ``rejected`` the two assistant answers as text.

Accepted record layouts (one file may mix them; detected per record):

1. plain strings: ``{"prompt": str, "chosen": str, "rejected": str}`` -> one user message;
2. chat messages: ``{"chosen": [messages], "rejected": [messages]}`` whose last message is the
   assistant answer and whose earlier messages (identical in both) are the prompt; an optional
   ``"prompt": [messages]`` is put in front (trl's explicit-prompt conversational layout);
3. ShareGPT / LLaMA-Factory (``dpo_en_demo.json``): ``{"conversations": [{"from": "human" | "gpt" |
   "system", "value": str}, ...], "chosen": {"from": "gpt", "value": str}, "rejected": {...}}``, with an
   optional top-level ``"system"`` string.

A file is a JSON list of records (``.json``) or one JSON object per line (``.jsonl``; blank lines are
skipped). A malformed record raises ``ConfigError`` naming the file and the record index.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Sequence, Union

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.data.assets import resolve_source
from hybridlm.data.chat import (RecordError, chat_messages, closing_ids, common_prefix_len, render_chat, render_prompt,
                                sharegpt_turn, token_ids)

IGNORE_INDEX = -100


class PreferencePair(NamedTuple):
    prompt_messages: List[Dict[str, str]]
    chosen: str
    rejected: str


# ------------------------------------------------------------------------------------- normalising


def _answer(v: Any, where: str) -> str:
    """A ShareGPT answer: a {from, value} turn spoken by the assistant, or a plain string."""
    if isinstance(v, str):
        return v
    turn = sharegpt_turn(v, where)
    if turn["role"] != "assistant":
        raise RecordError(f"{where}: the answer must come from the assistant (gpt), got {v.get('from')!r}")
    return turn["content"]


def normalize_record(rec: Any) -> PreferencePair:
    """One record of any accepted layout -> :class:`PreferencePair`; raises ``ConfigError`` if malformed."""
    try:
        return _normalize(rec)
    except RecordError as e:
        raise ConfigError(str(e)) from None


def _normalize(rec: Any) -> PreferencePair:
    if not isinstance(rec, dict):
        raise RecordError(f"expected a JSON object, got {type(rec).__name__}")
    for key in ("chosen", "rejected"):
        if key not in rec:
            raise RecordError(f"missing field {key!r} (expected prompt/chosen/rejected, chat messages, "
                               f"or ShareGPT conversations/chosen/rejected)")
    chosen, rejected = rec["chosen"], rec["rejected"]

    if "conversations" in rec:  # ShareGPT / LLaMA-Factory
        conv = rec["conversations"]
        if not isinstance(conv, list) or not conv:
            raise RecordError("conversations: expected a non-empty list of {from, value} turns")
        prompt = [sharegpt_turn(t, f"conversations[{i}]") for i, t in enumerate(conv)]
        system = rec.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise RecordError(f"system: expected a string, got {type(system).__name__}")
            if system and prompt[0]["role"] != "system":
                prompt.insert(0, {"role": "system", "content": system})
        pair = PreferencePair(prompt, _answer(chosen, "chosen"), _answer(rejected, "rejected"))

    elif isinstance(chosen, list) or isinstance(rejected, list):  # chat messages
        c, r = chat_messages(chosen, "chosen"), chat_messages(rejected, "rejected")
        for name, ms in (("chosen", c), ("rejected", r)):
            if not ms or ms[-1]["role"] != "assistant":
                raise RecordError(f"{name}: the last message must be the assistant's answer")
        if c[:-1] != r[:-1]:
            raise RecordError("chosen / rejected: the messages before the answers must be the same in both")
        prefix = chat_messages(rec["prompt"], "prompt") if "prompt" in rec else []
        pair = PreferencePair(prefix + c[:-1], c[-1]["content"], r[-1]["content"])

    else:  # plain strings
        prompt = rec.get("prompt")
        for name, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(v, str):
                raise RecordError(f"{name}: expected a string, got {type(v).__name__ if v is not None else 'nothing'}")
        pair = PreferencePair([{"role": "user", "content": prompt}], chosen, rejected)

    if not pair.prompt_messages:
        raise RecordError("the prompt is empty (no message before the answers)")
    if pair.prompt_messages[-1]["role"] == "assistant":
        raise RecordError("the prompt must not end with an assistant message")
    return pair


def load_preference_data(path: Union[str, Path]) -> List[PreferencePair]:
    """All pairs of a ``.json`` (a list of records) or ``.jsonl`` (one record per line) file, or of
    ``asset:<record set>`` (``asset:dpo_en_demo``)."""
    p = Path(resolve_source(str(path))).expanduser()
    if not p.is_file():
        raise ConfigError(f"{p}: preference data file not found (expected a .json or .jsonl file)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot be read as UTF-8 text ({e})") from None
    records: List[Any] = []
    if p.suffix.lower() == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((f"record {len(records)} (line {lineno})", json.loads(line)))
                except ValueError as e:
                    raise ConfigError(f"{p}: line {lineno} is not valid JSON ({e})") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{p}: not valid JSON ({e}); use a .jsonl suffix for one record per line") from None
        if not isinstance(data, list):
            raise ConfigError(f"{p}: expected a JSON list of preference records, got {type(data).__name__}")
        records = [(f"record {i}", r) for i, r in enumerate(data)]
    if not records:
        raise ConfigError(f"{p}: no preference records")
    pairs = []
    for where, rec in records:
        try:
            pairs.append(_normalize(rec))
        except RecordError as e:
            raise ConfigError(f"{p}: {where}: {e}") from None
    return pairs


# ------------------------------------------------------------------------------------- tokenizing


def render_texts(tokenizer, pair: PreferencePair) -> Dict[str, str]:
    """``prompt``, ``prompt_chosen`` and ``prompt_rejected``: the prompt text and the two whole
    conversations (prompt + answer) as the model sees them, without the eos that :func:`tokenize_pair`
    appends in the plain format. (Some chat templates render a prompt that is not a prefix of the whole
    conversation; tokenize_pair copes with that as trl does, by the common token prefix.)"""
    out = {"prompt": render_prompt(tokenizer, pair.prompt_messages)}
    for key, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        out[f"prompt_{key}"] = render_chat(tokenizer, [*pair.prompt_messages, {"role": "assistant", "content": answer}])
    return out


def tokenize_pair(tokenizer, example: Union[PreferencePair, Dict[str, Any]], max_length: int = 1024,
                  max_prompt_length: int = 512) -> Dict[str, Any]:
    """Token ids and labels of the chosen and rejected sequences of one pair.

    Returns ``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``, ``rejected_labels`` (lists; labels are
    -100 on the prompt) and ``prompt_length``. The text is the tokenizer's chat template when it has one, else the
    plain ``"User: …\\nAssistant: …"`` fallback template (:mod:`hybridlm.data.chat`). As in trl, prompt and prompt
    + answer are tokenized as whole strings and the answer starts where they first differ (a token merging across
    the boundary belongs to the answer); without a chat template the tokenizer's eos is appended to each answer
    (trl adds it to non-conversational completions; templates close the turn themselves).

    Truncation keeps the prompt a well-formed chat turn (:func:`truncate_prompt_messages`): a prompt longer than
    ``max_prompt_length`` tokens loses message content, never template tokens (role headers, turn markers, the
    generation prompt): content is cut from the left of the conversation (earliest turns first, the last user
    message's end survives) and the shortened messages are rendered through the template again. Then each answer
    is cut from the right so that prompt + answer fits ``max_length``.
    """
    for name, v in (("max_length", max_length), ("max_prompt_length", max_prompt_length)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}: expected a positive integer, got {v!r}")
    if max_prompt_length >= max_length:
        raise ConfigError(f"max_prompt_length: must be smaller than max_length {max_length} "
                          f"(leave room for the answer), got {max_prompt_length}")
    pair = example if isinstance(example, PreferencePair) else normalize_record(example)
    pair = pair._replace(prompt_messages=truncate_prompt_messages(tokenizer, pair.prompt_messages, max_prompt_length))
    texts = render_texts(tokenizer, pair)
    prompt_ids = token_ids(tokenizer, texts["prompt"])
    full = {}
    for key in ("chosen", "rejected"):
        full[key] = token_ids(tokenizer, texts[f"prompt_{key}"]) + closing_ids(tokenizer)
    n_prompt = min(common_prefix_len(prompt_ids, full["chosen"]), common_prefix_len(prompt_ids, full["rejected"]))
    prompt = prompt_ids[:n_prompt]
    answers = {k: v[n_prompt:] for k, v in full.items()}
    room = max_length - len(prompt)
    out: Dict[str, Any] = {"prompt_length": len(prompt)}
    for key, ans in answers.items():
        ans = ans[:room]
        out[f"{key}_input_ids"] = prompt + ans
        out[f"{key}_labels"] = [IGNORE_INDEX] * len(prompt) + ans
    return out


def prompt_token_count(tokenizer, messages: Sequence[Dict[str, str]]) -> int:
    """Tokens of the rendered prompt (template + contents + generation prompt)."""
    return len(token_ids(tokenizer, render_prompt(tokenizer, messages)))


def _cut_order(messages: Sequence[Dict[str, str]]) -> List[int]:
    """Indices of the messages in the order their content is cut: the turns before the last user message (oldest
    first), then the last user message, then the system message(s)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    body = [i for i, m in enumerate(messages) if m["role"] != "system" and i != last_user]
    tail = [last_user] if last_user is not None else []
    return body + tail + [i for i, m in enumerate(messages) if m["role"] == "system"]


def _token_starts(tokenizer, text: str) -> List[int]:
    """The character offset in ``text`` where each of its tokens (no special tokens) starts: from the offset mapping
    of a fast tokenizer, else by decoding growing token prefixes."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [start for start, _ in enc["offset_mapping"]]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [len(tokenizer.decode(ids[:i], clean_up_tokenization_spaces=False)) for i in range(len(ids))]


def _cut_messages(messages, order, starts, k: int) -> List[Dict[str, str]]:
    """``messages`` with the first ``k`` content tokens of the stream ``order`` cut away (the original text from the
    first kept token's start on), then each emptied turn before the last user message left out."""
    out = [dict(m) for m in messages]
    for i in order:
        if k <= 0:
            break
        n = len(starts[i])
        out[i]["content"] = out[i]["content"][starts[i][k]:] if k < n else ""
        k -= n
    # A turn before the last user message whose user message and replies are all empty is left out whole, so the
    # conversation keeps its user / assistant alternation.
    last_user = max((i for i, m in enumerate(out) if m["role"] == "user"), default=len(out))
    keep, group = [], []
    for i, m in enumerate(out):
        if i < last_user and m["role"] != "system":
            if m["role"] == "user" and group:
                keep += group if any(x["content"] for x in group) else []
                group = []
            group.append(m)
            continue
        if group:
            keep += group if any(x["content"] for x in group) else []
            group = []
        keep.append(m)
    return keep


def truncate_prompt_messages(tokenizer, messages: Sequence[Dict[str, str]],
                             max_prompt_length: int) -> List[Dict[str, str]]:
    """``messages`` shortened so that the rendered prompt has at most ``max_prompt_length`` tokens, with every
    template token kept: the chat stays well formed (each turn's header and end marker, the generation prompt).

    The rule: the fewest content tokens are removed from the left of the conversation's content stream, in this
    order: the turns before the last user message, oldest first (a user message's content, then its replies'); then
    the last user message's content (its end, nearest the answer, survives); the system message's content only when
    nothing else is left. A turn whose user message and replies are all cut away is dropped whole. Each cut falls
    at a token boundary of the content tokenized alone and keeps the original text from there on; the messages are
    rendered through the template again and the count is checked on the re-rendered prompt. A prompt that fits is
    returned unchanged. Raises ``ConfigError`` when the template's own tokens (every content cut away) exceed
    ``max_prompt_length``.
    """
    messages = [dict(m) for m in messages]
    if prompt_token_count(tokenizer, messages) <= max_prompt_length:
        return messages
    order = _cut_order(messages)
    starts = {i: _token_starts(tokenizer, messages[i]["content"]) for i in order}
    total = sum(len(v) for v in starts.values())

    def length(k):
        return prompt_token_count(tokenizer, _cut_messages(messages, order, starts, k))

    if length(total) > max_prompt_length:
        raise ConfigError(f"max_prompt_length: {max_prompt_length} tokens cannot hold this prompt's chat template "
                          f"even with all message content cut ({length(total)} tokens); raise max_prompt_length")
    lo, hi = 0, total  # length(lo) is over the limit, length(hi) is not: the smallest cut that fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if length(mid) <= max_prompt_length:
            hi = mid
        else:
            lo = mid
    return _cut_messages(messages, order, starts, hi)


def collate_pairs(features: Sequence[Dict[str, Any]], pad_token_id: int) -> Dict[str, torch.Tensor]:
    """A batch of tokenized pairs as one right-padded ``[chosen...; rejected...]`` batch (trl's layout):
    ``input_ids``, ``attention_mask`` and ``labels`` of shape ``(2B, T)``; the first B rows are chosen."""
    seqs = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
    labs = [f["chosen_labels"] for f in features] + [f["rejected_labels"] for f in features]
    T = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), T), pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), T), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labs)):
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        labels[i, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        attention_mask[i, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
