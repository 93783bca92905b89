"""Byte-level BPE tokenizers trained on one of the corpora: small vocabularies for small models.

The embedded CPU default trains a ~2M-parameter hybrid for a couple of minutes; with Llama-3.2's 128,256-token
vocabulary its embedding and LM head are 95 % of the weights and ~85 % of each step's time (BENCHMARKS.md, "Test
suites"). ``asset:janeausten-bpe8k`` is an 8,192-token byte-level BPE trained on Jane Austen's novels with the
``tokenizers`` library (deterministic: the same corpus gives the same file; ~1 s), built once into
``$HYBRIDLM_CACHE/tokenizers/<name>`` beside the fetched ones. Any text round-trips (byte level); documents end
with ``<|end_of_text|>``, as with the Llama-3.2 tokenizer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridlm.data import corpora
from hybridlm.data.cache import atomic_build, cache_dir
from hybridlm.utils.atomic import write_json
from hybridlm.utils.digest import sha256_of

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# name -> (corpus it is trained on, vocabulary size)
TRAINED: Dict[str, Tuple[str, int]] = {"janeausten-bpe8k": ("janeausten", 8192)}


def trained_tokenizer_path(name: str, fetch: bool = True) -> Path:
    """Directory holding the ``tokenizer.json`` of trained tokenizer ``name`` (built on first use)."""
    final = cache_dir() / "tokenizers" / name
    if fetch:
        atomic_build(final, lambda out: _train(name, out))
    return final


def _train(name: str, out: Path) -> None:
    corpus, vocab_size = TRAINED[name]
    files = sorted(str(f) for f in corpora.corpus_dir(corpus).rglob("*.txt"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                                               "eos_token": EOS, "pad_token": EOS, "clean_up_tokenization_spaces": False})
    write_json(out / "asset.json", {"name": name, "trained_on": f"asset:{corpus}", "documents": len(files),
                                    "vocab_size": vocab_size, "model": "byte-level BPE (tokenizers)",
                                    "tokenizer_json_sha256": sha256_of(out / "tokenizer.json")})
