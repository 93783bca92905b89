"""Chat records shared by every stage that reads conversations (KD-SFT data, DPO preference pairs):
message / ShareGPT-turn validation, rendering through the tokenizer's chat template (or a plain
``User: / Assistant:`` template without one) and token utilities."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


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


# The plain format for tokenizers without a chat template, as a chat template of its own: "System: ...\n",
# "User: ...\n", "Assistant: ...\n" a message; a conversation ending with the assistant's answer has no newline
# after it, and the generation prompt is "Assistant:" (the answer follows after one space, which belongs to the
# answer, so that the prompt ends on a token boundary: " Hello" is one token). The {% generation %} markers
# let transformers' ``return_assistant_tokens_mask`` find the answers (tests/test_chat.py compares it with
# :func:`hybridlm.data.sft.tokenize_conversation`'s labels). Without a template of its own, the tokenizer's
# bos / eos conventions apply (:func:`token_ids`, the eos the stages append after the last answer).
FALLBACK_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "Assistant:{% generation %} {{ message['content'] }}{% endgeneration %}"
    "{%- if not loop.last or add_generation_prompt %}{{ '\\n' }}{% endif -%}"
    "{%- else -%}"
    "{{ {'system': 'System', 'user': 'User'}[message['role']] }}: {{ message['content'] }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}Assistant:{% endif -%}"
)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_template(tokenizer) -> str:
    """The tokenizer's own chat template, or :data:`FALLBACK_CHAT_TEMPLATE`."""
    return tokenizer.chat_template if has_chat_template(tokenizer) else FALLBACK_CHAT_TEMPLATE


def render_chat(tokenizer, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = False) -> str:
    """``messages`` as text through the chat template (the tokenizer's, else the plain fallback)."""
    return tokenizer.apply_chat_template(list(messages), chat_template=chat_template(tokenizer), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def render_prompt(tokenizer, messages: Sequence[Dict[str, str]]) -> str:
    """The prompt text, ending where the assistant's answer starts (use it for generation too)."""
    return render_chat(tokenizer, messages, add_generation_prompt=True)


def token_ids(tokenizer, text: str) -> List[int]:
    # Chat templates write their own special tokens (bos); the plain format relies on the tokenizer's.
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]


def closing_ids(tokenizer) -> List[int]:
    """Token ids after the last answer: a chat template closes the turn itself; the plain format ends with the
    tokenizer's eos (trl adds it to non-conversational completions too), so the model learns to stop."""
    if has_chat_template(tokenizer) or tokenizer.eos_token_id is None:
        return []
    return [tokenizer.eos_token_id]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
