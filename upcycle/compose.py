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
  the same teacher, so they must be identical in the two students. This is verified (bitwise,
  :func:`hybridlm.students.check_shared_weights`); a difference is a :class:`ConfigError` (the students do not
  come from the same teacher / run). The linear-mixer student's copies are used.

The config follows :func:`upcycle.student.student_config`: pattern ``*`` for MLA layers and the other
student's mixer symbol elsewhere (``pattern_for``), the ``mla`` arguments of the MLA student and every
other field (widths, vocab, norms eps, tying, the ``mamba2`` / ``gdn`` / ``kda`` arguments, special token
ids) from the linear-mixer student.

``compose_from_dirs`` does the same on saved student directories and writes the hybrid atomically (with
the tokenizer of the linear-mixer student's directory and a ``compose.json`` of its provenance); ``upcycle compose``
(:func:`add_subcommand`) runs it on the MLA layers of ``--mla-layers`` or of a SMART report (``--from-smart``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence, Union

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.config.layers import parse_layers
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.configuration import REMOTE_CODE_HELP
from hybridlm.model.generate import save_tokenizer, set_generation_defaults
from hybridlm.students import check_layers, check_shared_weights, check_students, load_student, load_student_config
from hybridlm.teacher import check_tokenizer_matches, load_teacher_tokenizer
from hybridlm.utils.atomic import atomic_directory, write_json
from hybridlm.utils.flags import RenamedFlag
from smart_select.report import layers_from_report
from upcycle.student import pattern_for

PathLike = Union[str, os.PathLike]
COMPOSE_INFO = "compose.json"


# ---------------------------------------------------------------------------------------- composing
def composed_config(mla_cfg: HybridConfig, mamba_cfg: HybridConfig, mla_layers: Sequence[int]) -> HybridConfig:
    """The hybrid's config: ``*`` at ``mla_layers``, the linear student's mixer elsewhere (``pattern_for``)."""

    L, linear = check_students(mla_cfg, mamba_cfg)
    chosen = set(check_layers(mla_layers, L))
    layer_kinds = ["mla" if i in chosen else linear for i in range(L)]
    values = mamba_cfg.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "num_hidden_layers", "_name_or_path"):
        values.pop(key, None)
    values.update(hybrid_override_pattern=pattern_for(layer_kinds), num_layers=2 * L, hybrid_attention_ratio=None,
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
    mla_layers = check_layers(mla_layers, L)  # fail before loading any weights
    mla = load_student(mla_dir, "mla student")
    mamba = load_student(mamba_dir, "mamba student")
    tokenizer = load_teacher_tokenizer(mamba_dir)
    check_tokenizer_matches(load_teacher_tokenizer(mla_dir), tokenizer)
    hybrid = compose_hybrid(mla, mamba, mla_layers)
    info = {"mla_student": str(Path(mla_dir).resolve()), "mamba_student": str(Path(mamba_dir).resolve()),
            "mla_layers": mla_layers, "num_layers": L, "linear_mixer": linear,
            "pattern": hybrid.config.hybrid_override_pattern,
            "layer_sources": layer_sources(L, mla_layers),
            "shared_weights_from": "mamba student (checked equal to the MLA student's)",
            "mla": {k: hybrid.config.mla[k] for k in ("kv_lora_rank", "qk_rope_head_dim")}}
    with atomic_directory(out, overwrite=overwrite) as tmp:
        set_generation_defaults(hybrid, tokenizer)
        hybrid.save_pretrained(tmp, remote_code=remote_code)
        save_tokenizer(tokenizer, tmp)
        write_json(tmp / COMPOSE_INFO, info)
    return {**info, "out": str(out)}


# ---------------------------------------------------------------------------------------------- CLI
def cmd_compose(args) -> Dict[str, Any]:
    for flag, d in (("--mla-student", args.mla_student), ("--linear-student", args.linear_student)):
        if not Path(d).expanduser().is_dir():
            raise ConfigError(f"{flag}: {d} is not a directory")
    if (args.mla_layers is None) == (args.from_smart is None):
        raise ConfigError("compose: give exactly one of --mla-layers or --from-smart")
    if args.mla_layers is not None:
        mla_layers = parse_layers(args.mla_layers, "--mla-layers")
    else:
        mla_layers, n = layers_from_report(args.from_smart)
        cfg_file = Path(args.linear_student).expanduser() / "config.json"
        if n is not None and cfg_file.is_file():
            plan_len = len(json.loads(cfg_file.read_text(encoding="utf-8")).get("hybrid_override_pattern", ""))
            if plan_len and plan_len != 2 * n:
                raise ConfigError(f"--from-smart: the report is for {n} layers, the students have {plan_len // 2}")
    info = compose_from_dirs(args.mla_student, args.linear_student, mla_layers, args.out, overwrite=args.overwrite,
                             remote_code=args.remote_code)
    print(f"hybrid {info['pattern']} (MLA layers {','.join(map(str, info['mla_layers'])) or 'none'}) -> {info['out']}",
          flush=True)
    return info


def add_subcommand(subparsers) -> None:
    """Register ``compose`` on an ``argparse`` subparsers object (``fn`` takes the namespace)."""
    c = subparsers.add_parser("compose", help="compose the MLA + Mamba2 hybrid from the two students")
    c.add_argument("--mla-student", required=True)
    c.add_argument("--linear-student", "--mamba-student", required=True, action=RenamedFlag, old=("--mamba-student",),
                   help="the pure linear-mixer student directory (--mamba-student: its old name)")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--mla-layers", default=None, help="comma-separated MLA layers, e.g. 0,5,10,14")
    g.add_argument("--from-smart", default=None, help="smart_report.json (or its directory) of `upcycle smart`")
    c.add_argument("--out", required=True)
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--remote-code", action="store_true",
                   help=REMOTE_CODE_HELP)
    c.set_defaults(fn=cmd_compose)


__all__ = ["compose_hybrid", "compose_from_dirs", "composed_config", "layer_sources", "add_subcommand"]
