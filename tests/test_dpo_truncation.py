"""Truncated preference prompts stay well-formed chats under a ChatML template whose first token is not a bos.

The tokenizer is the real Llama-3.2 tokenizer with ``<|im_start|>`` / ``<|im_end|>`` added as special tokens and
SmolLM2-135M-Instruct's chat template (ChatML; it writes a default system turn when the conversation has none),
so the rendered prompt starts with ``<|im_start|>``, a template token, where the rule of keeping a leading bos
would have cut the role header away. A well-formed prompt is a sequence of whole ChatML turns
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` followed by the generation prompt ``<|im_start|>assistant\\n``.
"""
import copy
import re

import pytest

from conftest import demo_file
from distill.preference_data import (PreferencePair, load_preference_data, prompt_token_count, render_prompt,
                                     tokenize_pair, truncate_prompt_messages)

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GEN_PROMPT = "<|im_start|>assistant\n"
TURNS = re.compile(r"(?:<\|im_start\|>(system|user|assistant)\n(?:(?!<\|im_start\|>).)*?<\|im_end\|>\n)+"
                   + re.escape(GEN_PROMPT), re.S)
# Demo pairs whose rendered prompt exceeds 512 tokens (this tokenizer: 94; SmolLM2's own tokenizer: 101).
TRUNCATED_AT_512 = 94
SMOLLM2_TRUNCATED_AT_512 = 101


@pytest.fixture(scope="module")
def chatml():
    from hybridlm.data.assets import load_tokenizer
    t = copy.deepcopy(load_tokenizer("asset:llama3.2"))
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = SMOLLM2_TEMPLATE
    return t


def roles(text):
    return re.findall(r"<\|im_start\|>(system|user|assistant)\n", text)


def well_formed(tok, out, messages):
    n = out["prompt_length"]
    text = tok.decode(out["chosen_input_ids"][:n])
    return (TURNS.fullmatch(text) is not None and text.startswith("<|im_start|>system\n")
            and text.endswith("<|im_end|>\n" + GEN_PROMPT) and "<|im_start|>user\n" in text
            and text == render_prompt(tok, messages))


def test_long_user_message_is_cut_inside_its_content(chatml):
    im_start = chatml.convert_tokens_to_ids("<|im_start|>")
    long_q = " ".join(f"word{i}" for i in range(600)) + " Which word comes last?"
    pair = PreferencePair([{"role": "user", "content": long_q}], "word599", "word0")
    out = tokenize_pair(chatml, pair, max_length=160, max_prompt_length=96)
    n = out["prompt_length"]
    assert 90 <= n <= 96 and len(out["chosen_input_ids"]) <= 160
    assert out["chosen_input_ids"][0] == im_start != chatml.bos_token_id
    kept = truncate_prompt_messages(chatml, pair.prompt_messages, 96)
    assert [m["role"] for m in kept] == ["user"] and long_q.endswith(kept[0]["content"])
    assert well_formed(chatml, out, kept)
    text = chatml.decode(out["chosen_input_ids"][:n])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(" Which word comes last?<|im_end|>\n" + GEN_PROMPT)
    assert chatml.decode(out["chosen_input_ids"][n:]) == "word599<|im_end|>\n"


def test_earlier_turns_are_cut_before_the_last_question(chatml):
    filler = " ".join(f"w{i}" for i in range(300))
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "First question " + filler}, {"role": "assistant", "content": "Reply " + filler},
            {"role": "user", "content": "Second question?"}, {"role": "assistant", "content": "Second reply " + filler},
            {"role": "user", "content": "The last question?"}]
    full = prompt_token_count(chatml, msgs)
    # a small cut: the first user message loses the left of its content, every turn remains
    kept = truncate_prompt_messages(chatml, msgs, full - 50)
    assert [m["role"] for m in kept] == [m["role"] for m in msgs]
    assert prompt_token_count(chatml, kept) <= full - 50 and kept[1]["content"] != msgs[1]["content"]
    assert msgs[1]["content"].endswith(kept[1]["content"]) and kept[2:] == msgs[2:] and kept[0] == msgs[0]
    # a larger cut: the whole first turn (question and reply) goes, the later ones keep their alternation
    kept = truncate_prompt_messages(chatml, msgs, 400)
    assert [m["role"] for m in kept] == ["system", "user", "assistant", "user"]
    assert kept[0] == msgs[0] and kept[-1] == msgs[-1] and msgs[4]["content"].endswith(kept[2]["content"])
    # only the last question and the system message fit: the question's end survives
    kept = truncate_prompt_messages(chatml, msgs, 24)
    assert [m["role"] for m in kept] == ["system", "user"] and kept[0] == msgs[0]
    assert "The last question?".endswith(kept[1]["content"])
    out = tokenize_pair(chatml, PreferencePair(msgs, "Yes.", "No."), max_length=64, max_prompt_length=24)
    assert out["prompt_length"] <= 24 and well_formed(chatml, out, kept)
    assert roles(chatml.decode(out["chosen_input_ids"][:out["prompt_length"]])) == ["system", "user", "assistant"]


def test_fitting_prompt_is_unchanged(chatml):
    msgs = [{"role": "user", "content": "Hello there"}]
    assert truncate_prompt_messages(chatml, msgs, 512) == msgs


def check_demo_pairs(chatml):
    """The 300 demo pairs at the H200 limits (1024 / 512): every truncated prompt is whole turns + the generation
    prompt, fits 512 tokens, and keeps the last user message's end. Returns how many were truncated."""
    pairs = load_preference_data(demo_file("dpo_en_demo.json"))
    truncated = 0
    for pair in pairs:
        out = tokenize_pair(chatml, pair, max_length=1024, max_prompt_length=512)
        n = out["prompt_length"]
        assert n <= 512 and len(out["chosen_input_ids"]) <= 1024 and len(out["rejected_input_ids"]) <= 1024
        if prompt_token_count(chatml, pair.prompt_messages) <= 512:
            continue
        truncated += 1
        kept = truncate_prompt_messages(chatml, pair.prompt_messages, 512)
        assert well_formed(chatml, out, kept)
        assert n >= 500  # the fewest content tokens were cut
        assert pair.prompt_messages[-1]["content"].endswith(kept[-1]["content"]) and kept[-1]["role"] == "user"
    return truncated


def test_real_demo_pairs_stay_well_formed(chatml):
    assert check_demo_pairs(chatml) == TRUNCATED_AT_512


def test_real_demo_pairs_with_smollm2_tokenizer():
    """The same with SmolLM2-135M-Instruct's own tokenizer, whose bos is ``<|im_start|>``; only where the teacher
    is already in the asset cache (tests do not fetch it)."""
    from hybridlm.teacher import load_teacher_tokenizer, smollm2_path
    path = smollm2_path(fetch=False)
    if not (path / "tokenizer.json").is_file():
        pytest.skip("asset:smollm2 is not in the asset cache")
    tok = load_teacher_tokenizer(path)
    assert tok.bos_token == "<|im_start|>" and tok.chat_template
    assert check_demo_pairs(tok) == SMOLLM2_TRUNCATED_AT_512
