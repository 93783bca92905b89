"""Chat rendering (hybridlm/data/chat.py): the plain fallback chat template and the assistant masks of
hybridlm/data/sft.py against transformers' own ``return_assistant_tokens_mask``."""
import pytest

from hybridlm.data.chat import FALLBACK_CHAT_TEMPLATE, render_chat, render_prompt
from hybridlm.data.sft import IGNORE_INDEX, tokenize_conversation

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "and more"},
        {"role": "assistant", "content": "ok then"}]


@pytest.fixture(scope="module")
def llama_tok():
    from hybridlm.data import load_tokenizer
    tok = load_tokenizer("asset:llama3.2")
    assert not tok.chat_template  # the tokenizer.json asset has none: the fallback applies
    return tok


def test_fallback_template_renders_the_plain_format(llama_tok):
    assert render_prompt(llama_tok, CHAT[:2]) == "System: Be brief.\nUser: hi\nAssistant:"
    assert render_chat(llama_tok, CHAT[:3]) == "System: Be brief.\nUser: hi\nAssistant: Hello there"
    assert render_prompt(llama_tok, CHAT[:4]) == \
        "System: Be brief.\nUser: hi\nAssistant: Hello there\nUser: and more\nAssistant:"
    assert render_chat(llama_tok, CHAT) == render_prompt(llama_tok, CHAT[:4]) + " ok then"


def test_assistant_labels_equal_transformers_assistant_mask(llama_tok):
    """transformers marks the tokens inside the template's {% generation %} blocks; our labels (found by
    token-prefix matching, which also works for templates without those markers) cover the same tokens,
    plus the eos the plain format appends after the last answer."""
    enc = llama_tok.apply_chat_template(CHAT, chat_template=FALLBACK_CHAT_TEMPLATE, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    ours = tokenize_conversation(llama_tok, CHAT, 512)
    bos, body, eos = ours["input_ids"][0], ours["input_ids"][1:-1], ours["input_ids"][-1]
    assert (bos, eos) == (llama_tok.bos_token_id, llama_tok.eos_token_id)
    assert body == list(enc["input_ids"])  # the template's tokens, between the tokenizer's bos and eos
    mask = [int(label != IGNORE_INDEX) for label in ours["labels"][1:-1]]
    assert sum(mask) > 0 and mask == list(enc["assistant_masks"])
    assert ours["labels"][-1] == eos  # the model learns to stop


def test_a_tokenizers_own_template_wins(llama_tok):
    import copy
    tok = copy.deepcopy(llama_tok)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
                        "{% if add_generation_prompt %}[assistant]{% endif %}"
    assert render_prompt(tok, CHAT[:2]) == "[system]Be brief.[user]hi[assistant]"
