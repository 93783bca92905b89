"""Chat records shared by every stage that reads conversations (KD-SFT data, DPO preference pairs):
message / ShareGPT-turn validation, prompt rendering with the tokenizer's chat template (or a plain
``User: / Assistant:`` format without one) and token helpers."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
FALLBACK_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


class RecordError(Exception):
    """A problem with one record; turned into a ConfigError naming the file and index."""


def short_repr(v: Any, n: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def chat_message(m: Any, where: str) -> Dict[str, str]:
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise RecordError(f"{where}: expected a message {{role, content}}, got {short_repr(m)}")
    if m["role"] not in ROLES:
        raise RecordError(f"{where}: role must be one of {list(ROLES)}, got {m['role']!r}")
    if not isinstance(m["content"], str):
        raise RecordError(f"{where}: content must be a string, got {type(m['content']).__name__}")
    return {"role": m["role"], "content": m["content"]}


def chat_messages(ms: Any, where: str) -> List[Dict[str, str]]:
    if not isinstance(ms, list):
        raise RecordError(f"{where}: expected a list of messages, got {type(ms).__name__}")
    return [chat_message(m, f"{where}[{i}]") for i, m in enumerate(ms)]


def sharegpt_turn(t: Any, where: str) -> Dict[str, str]:
    if not isinstance(t, dict) or "from" not in t or "value" not in t:
        raise RecordError(f"{where}: expected a turn {{from, value}}, got {short_repr(t)}")
    role = SHAREGPT_ROLES.get(t["from"])
    if role is None:
        raise RecordError(f"{where}: 'from' must be one of {sorted(SHAREGPT_ROLES)}, got {t['from']!r}")
    if not isinstance(t["value"], str):
        raise RecordError(f"{where}: value must be a string, got {type(t['value']).__name__}")
    return {"role": role, "content": t["value"]}


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, messages: Sequence[Dict[str, str]]) -> str:
    """The prompt text, ending where the assistant's answer starts (use it for generation too).

    With a chat template: the template with ``add_generation_prompt=True``. Without one, the plain format
    ``"System: …\\n"`` / ``"User: …\\n"`` / ``"Assistant: …\\n"`` a message, then ``"Assistant:"``; the
    answer follows after one space (``"User: hi\\nAssistant: Hello"``). The space belongs to the answer
    so that the prompt ends on a token boundary (`` Hello`` is one token; a prompt ending in a lone space
    would be tokenized differently at training and at generation time).
    """
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "".join(f"{FALLBACK_NAMES[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"


def token_ids(tokenizer, text: str) -> List[int]:
    # Chat templates write their own special tokens (bos); the plain format relies on the tokenizer's.
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
