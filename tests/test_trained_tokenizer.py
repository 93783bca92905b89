"""The embedded default's tokenizer: an 8,192-token byte-level BPE trained on Jane Austen's novels, the same file
from the same corpus, any text round-tripping, end-of-text as the document separator."""
from hybridlm.data import load_tokenizer
from hybridlm.data.trained_tokenizers import EOS, _train, trained_tokenizer_path


def test_training_is_deterministic(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _train("janeausten-bpe8k", tmp_path / "a")
    _train("janeausten-bpe8k", tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_loads_as_the_default_tokenizer_and_round_trips():
    tok = load_tokenizer("asset:janeausten-bpe8k")
    assert len(tok) == 8192 and tok.eos_token == EOS and tok.eos_token_id is not None
    assert trained_tokenizer_path("janeausten-bpe8k").joinpath("asset.json").is_file()
    austen = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    ids = tok(austen, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 20 and tok.decode(ids) == austen  # whole words of the corpus are single tokens
    other = "naïve café — 東京 🙂 x=1e-3\n\ttabs"
    assert tok.decode(tok(other, add_special_tokens=False)["input_ids"]) == other  # byte level: nothing is lost
