"""Local text for the RULER-style tasks: the essay haystack as sentences, and a pool of plain words.

RULER fills its essay haystacks with Paul Graham's essays fetched at run time; here any text source that
:func:`hybridlm.data.prepare.iter_documents` reads does (``asset:sotu`` by default: a corpus no route stage trains
on; ``asset:janeausten``, ``.txt`` files, folders), so the tasks build without a network.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Sequence

from hybridlm.config.errors import ConfigError
from hybridlm.data.prepare import iter_documents

DEFAULT_HAYSTACK = "asset:sotu"
MAX_CHARS = 4_000_000  # ~1M tokens of English: far more than one item of the longest context takes
MIN_SENTENCES = 64
# a sentence ends at . ! or ? (optionally closed by a quote or bracket) followed by white space
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+")
_WORD = re.compile(r"\b[a-z]{4,10}\b")  # whole lowercase words only


@dataclass
class Haystack:
    """``sentences`` of the source text (white space collapsed) and ``words``: its distinct lowercase words of 4-10
    letters, sorted (the word lists of the common-words task and the keys of the needles)."""

    source: str
    sentences: List[str]
    words: List[str]


def split_sentences(text: str) -> List[str]:
    text = " ".join(text.split())
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def load_haystack(sources: Sequence[str], max_chars: int = MAX_CHARS) -> Haystack:
    """The sentences and word pool of ``sources`` (documents in order, up to ``max_chars`` characters)."""
    name = ", ".join(sources)
    texts, size = [], 0
    try:
        for doc in iter_documents(list(sources)):
            texts.append(doc)
            size += len(doc)
            if size >= max_chars:
                break
    except ConfigError as e:  # a missing file, an unknown asset: named as the haystack's
        raise ConfigError(f"--haystack: {e}") from None
    sentences = [s for doc in texts for s in split_sentences(doc)]
    if len(sentences) < MIN_SENTENCES:
        raise ConfigError(f"--haystack {name!r}: {len(sentences)} sentences of text, at least {MIN_SENTENCES} needed")
    words = sorted({w for s in sentences for w in _WORD.findall(s)})
    if len(words) < 200:
        raise ConfigError(f"--haystack {name!r}: {len(words)} distinct plain words, at least 200 needed")
    return Haystack(name, sentences, words)
