"""The two students of one Llama teacher, as ``upcycle init`` writes them and ILD trains them: a pure-MLA student
and a pure linear-mixer (Mamba2 / GDN / KDA) student. Loading them strictly, and checking that they fit together,
which both SMART (:mod:`smart_select.stage`) and composing the hybrid (:mod:`upcycle.compose`) need.

ILD keeps the embeddings, the final norm and the LM head frozen, and both students were initialised from the same
teacher, so those weights must be bitwise equal in the two (:func:`check_shared_weights`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Tuple, Union

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.config.layers import validate_layers
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.pattern import student_kinds

PathLike = Union[str, os.PathLike]
SHARED_KEYS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")  # frozen in ILD


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

