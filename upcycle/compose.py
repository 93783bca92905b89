"""Compose the MLA + Mamba2 hybrid from the two ILD students (after SMART picks the MLA layers).

``compose_hybrid(mla_student, mamba_student, mla_layers)`` returns a new ``HybridForCausalLM`` whose
teacher layer ``i`` (sublayers ``2i`` mixer and ``2i + 1`` MLP) is taken whole from the MLA student when
``i in mla_layers`` and from the linear-mixer (Mamba2 / GDN / KDA) student otherwise.

Which weights come from where, and why:

* **Decoder layer i** (mixer, its pre-norm, the MLP and its pre-norm): from the student whose mixer
  layer i uses. ILD trains *every* decoder-layer parameter of each student against the teacher, so the
  MLP and norms of layer i co-adapted with that student's mixer of layer i; mixing an MLA mixer with a
  Mamba2-tuned MLP would pair parts that were never trained together.
* **Embeddings, final norm, LM head**: ILD keeps them frozen, and both students were initialised from
  the same teacher, so they must be identical in the two students. This is verified (bitwise); a
  difference is a :class:`ConfigError` (the students do not come from the same teacher / run). The
  linear-mixer student's copies are used.

The config follows :func:`upcycle.student.student_config`: pattern ``*`` for MLA layers and the other
student's mixer symbol elsewhere (``pattern_for``), the ``mla`` arguments of the MLA student and every
other field (widths, vocab, norms eps, tying, the ``mamba2`` / ``gdn`` / ``kda`` arguments, special token
ids) from the linear-mixer student.

``compose_from_dirs`` does the same on saved student directories and writes the hybrid atomically (with
the tokenizer of the linear-mixer student's directory and a ``compose.json`` of its provenance).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence, Tuple, Union

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.config.layers import validate_layers
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.generate import save_tokenizer, set_generation_defaults
from hybridlm.model.pattern import student_kinds
from hybridlm.teacher import check_tokenizer_matches, load_teacher_tokenizer
from hybridlm.utils.atomic import atomic_directory, write_json
from upcycle.student import pattern_for

PathLike = Union[str, os.PathLike]
SHARED_KEYS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")  # frozen in ILD
COMPOSE_INFO = "compose.json"


def check_students(mla_cfg: HybridConfig, mamba_cfg: HybridConfig) -> Tuple[int, str]:
    """ConfigError unless the two students fit together; returns (number of layers, linear mixer kind)."""
    mla_kinds = student_kinds(mla_cfg, "mla student")
    lin_kinds = student_kinds(mamba_cfg, "mamba student")
    if set(mla_kinds) != {"mla"}:
        raise ConfigError(f"mla student: expected MLA in every layer, got pattern {mla_cfg.hybrid_override_pattern!r}")
    kinds = set(lin_kinds)
    if len(kinds) != 1 or "mla" in kinds:
        raise ConfigError(f"mamba student: expected one linear mixer (mamba2, gdn or kda) in every layer, "
                          f"got pattern {mamba_cfg.hybrid_override_pattern!r}")
    if len(mla_kinds) != len(lin_kinds):
        raise ConfigError(f"students: the MLA student has {len(mla_kinds)} layers, the mamba student {len(lin_kinds)}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "tie_word_embeddings"):
        a, b = getattr(mla_cfg, key), getattr(mamba_cfg, key)
        if a != b:
            raise ConfigError(f"students: {key} differs (MLA student {a}, mamba student {b})")
    return len(lin_kinds), lin_kinds[0]


def check_layers(mla_layers: Any, num_layers: int) -> List[int]:
    """Sorted, unique, in-range layer indices (ConfigError otherwise)."""
    return validate_layers(mla_layers, None, num_layers, field="mla_layers")


def check_shared_weights(mla_student, mamba_student) -> None:
    """Embeddings, final norm and LM head must be bitwise equal in both students (frozen in ILD)."""
    a, b = mla_student.state_dict(), mamba_student.state_dict()
    for key in SHARED_KEYS:
        if key not in a or key not in b:
            raise ConfigError(f"students: {key} missing from a student's weights")
        if a[key].shape != b[key].shape or not torch.equal(a[key].to(b[key].device, b[key].dtype), b[key]):
            raise ConfigError(f"students: {key} differs between the MLA and mamba students (ILD keeps it frozen; "
                              f"were both students initialised from the same teacher?)")


# ---------------------------------------------------------------------------------------- composing
def composed_config(mla_cfg: HybridConfig, mamba_cfg: HybridConfig, mla_layers: Sequence[int]) -> HybridConfig:
    """The hybrid's config: ``*`` at ``mla_layers``, the linear student's mixer elsewhere (``pattern_for``)."""

    L, linear = check_students(mla_cfg, mamba_cfg)
    chosen = set(check_layers(mla_layers, L))
    kinds = ["mla" if i in chosen else linear for i in range(L)]
    values = mamba_cfg.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "num_hidden_layers", "_name_or_path"):
        values.pop(key, None)
    values.update(hybrid_override_pattern=pattern_for(kinds), num_layers=2 * L, hybrid_attention_ratio=None,
                  mixer=linear, mla=dict(mla_cfg.mla))
    return HybridConfig.from_dict(values)


def layer_sources(num_layers: int, mla_layers: Sequence[int]) -> List[str]:
    """``"mla"`` or ``"linear"`` per teacher layer: which student each decoder layer comes from."""
    chosen = set(mla_layers)
    return ["mla" if i in chosen else "linear" for i in range(num_layers)]


def compose_hybrid(mla_student: HybridForCausalLM, mamba_student: HybridForCausalLM,
                   mla_layers: Sequence[int]) -> HybridForCausalLM:
    """A new hybrid: decoder layer ``i`` from the MLA student if ``i in mla_layers``, else from the linear
    (Mamba2) student; embeddings / final norm / LM head from the linear student (checked equal to the MLA
    student's). The students are not modified; the result has the linear student's dtype and device."""
    if not isinstance(mla_layers, (str, bytes)) and isinstance(mla_layers, Iterable):
        mla_layers = list(mla_layers)  # a generator is read once, here
    cfg = composed_config(mla_student.config, mamba_student.config, mla_layers)
    check_shared_weights(mla_student, mamba_student)
    chosen = set(mla_layers)
    ref = next(mamba_student.parameters())
    with torch.random.fork_rng(devices=[]):  # the throw-away random init must not move the caller's RNG
        model = HybridForCausalLM(cfg)
    model.to(device=ref.device, dtype=ref.dtype)
    src_mla, src_lin = mla_student.state_dict(), mamba_student.state_dict()
    state: Dict[str, torch.Tensor] = {}
    for key in model.state_dict():
        src = src_lin
        if key.startswith("model.layers."):
            sub = int(key.split(".")[2])
            src = src_mla if sub // 2 in chosen else src_lin
        if key not in src:
            raise ConfigError(f"compose: {key} is missing from the {'MLA' if src is src_mla else 'mamba'} student")
        state[key] = src[key]
    model.load_state_dict(state, strict=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


# ----------------------------------------------------------------------------------------- on disk
def _student_dir(path: PathLike, who: str) -> Path:
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ConfigError(f"{who}: {p} has no config.json (expected a student directory from `upcycle init` "
                          f"or an ILD stage's final/)")
    return p


def load_student_config(path: PathLike, who: str) -> HybridConfig:
    """Only the config of a student directory (cheap: for validating before loading weights)."""
    p = _student_dir(path, who)
    try:
        return HybridConfig.from_pretrained(str(p))
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{who}: {p}/config.json is not a hybrid config ({msg})") from None


def load_student(path: PathLike, who: str) -> HybridForCausalLM:
    """A student directory (``upcycle init`` / ``ild`` output) loaded strictly; one-line errors."""
    p = _student_dir(path, who)
    try:
        model = HybridForCausalLM.from_pretrained(str(p))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{who}: {p} cannot be loaded as a hybrid student ({msg})") from None
    return model.eval()


def compose_from_dirs(mla_dir: PathLike, mamba_dir: PathLike, mla_layers: Sequence[int], out_dir: PathLike,
                      overwrite: bool = False, remote_code: bool = False) -> Dict[str, Any]:
    """Load both students, compose, write ``out_dir`` atomically (weights, config, the linear student's
    tokenizer, ``compose.json``; ``remote_code``: also ``hybrid_lm_auto.py``, see
    :func:`hybridlm.model.configuration.write_remote_code`); returns the compose.json dict."""

    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise ConfigError(f"--out: {out} already exists (pass --overwrite to replace it)")
    L, linear = check_students(load_student_config(mla_dir, "mla student"),
                               load_student_config(mamba_dir, "mamba student"))
    layers = check_layers(mla_layers, L)  # fail before loading any weights
    mla = load_student(mla_dir, "mla student")
    mamba = load_student(mamba_dir, "mamba student")
    tokenizer = load_teacher_tokenizer(mamba_dir)
    check_tokenizer_matches(load_teacher_tokenizer(mla_dir), tokenizer)
    hybrid = compose_hybrid(mla, mamba, layers)
    info = {"mla_student": str(Path(mla_dir).resolve()), "mamba_student": str(Path(mamba_dir).resolve()),
            "mla_layers": layers, "num_layers": L, "linear_mixer": linear,
            "pattern": hybrid.config.hybrid_override_pattern,
            "layer_sources": layer_sources(L, layers),
            "shared_weights_from": "mamba student (checked equal to the MLA student's)",
            "mla": {k: hybrid.config.mla[k] for k in ("kv_lora_rank", "qk_rope_head_dim")}}
    with atomic_directory(out, overwrite=overwrite) as tmp:
        set_generation_defaults(hybrid, tokenizer)
        hybrid.save_pretrained(tmp, remote_code=remote_code)
        save_tokenizer(tokenizer, tmp)
        write_json(tmp / COMPOSE_INFO, info)
    return {**info, "out": str(out)}


__all__ = ["compose_hybrid", "compose_from_dirs", "composed_config", "check_students", "check_layers",
           "check_shared_weights", "load_student", "load_student_config", "layer_sources"]
