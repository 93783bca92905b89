"""``upcycle init``: build, calibrate and save the pure-MLA and pure linear-mixer students of a Llama teacher."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Union

import torch

from hybridlm.kv_report import format_kv_report, kv_layers, kv_report
from hybridlm.model import HybridForCausalLM
from hybridlm.model.generate import save_tokenizer, set_generation_defaults
from hybridlm.teacher import load_teacher, load_teacher_tokenizer
from hybridlm.utils.atomic import atomic_directory, write_json
from upcycle.calibrate import calibrate_student, calibration_batch
from upcycle.init_from_teacher import init_student_from_teacher
from upcycle.init_mla import energy_ranks
from upcycle.student import llama_shapes, rope_mismatch, student_config


@dataclass
class InitConfig:
    """The ``init:`` section of a route and the options of ``upcycle init`` (its flags default to these fields).

    ``q_lora_rank`` / ``kv_lora_rank`` and ``qk_rope_head_dim`` are the MLA student's, under the names its saved
    config gives them (``q_lora_rank`` None: the full ``n_heads * head_dim``; ``energy``: both ranks chosen by kept
    sigma^2 energy instead). The linear mixers' output scales are fitted to the teacher's attention outputs on
    ``calib_tokens`` tokens of ``calib_sources`` in windows of ``calib_seq_len`` (:mod:`upcycle.calibrate`;
    ``calib_tokens: 0`` skips it). ``remote_code``: also write ``hybrid_lm_auto.py`` into each student
    (:func:`hybridlm.model.configuration.write_remote_code`)."""

    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 128
    energy: Optional[float] = None
    qk_rope_head_dim: int = 32
    rope_init: str = "frequency_matched"
    linear_mixer: str = "mamba2"
    seed: int = 0
    calib_sources: Union[List[str], str] = field(default_factory=lambda: ["asset:janeausten"])
    calib_tokens: int = 4096
    calib_seq_len: int = 512
    remote_code: bool = False


def init_students(cfg: InitConfig, teacher_spec, out, *, overwrite: bool = False) -> dict:
    """Build and save the pure-MLA and pure linear-mixer students of a Llama teacher (``upcycle init``) into
    ``out/mla_student`` and ``out/<linear_mixer>_student``, with ``out/init_report.json``; ``cfg`` is the
    :class:`InitConfig`."""

    teacher = load_teacher(teacher_spec, dtype=torch.float32)
    tokenizer = load_teacher_tokenizer(teacher_spec)
    s = llama_shapes(teacher.config)
    ranks = {"q_lora_rank": cfg.q_lora_rank or s["n_h"] * s["d_h"], "kv_lora_rank": cfg.kv_lora_rank}
    if cfg.energy is not None:  # one MLA shape for all layers: the largest rank any layer needs
        ranks = energy_ranks([l.self_attn for l in teacher.model.layers], s["n_h"], s["n_kv"], s["d_h"],
                             cfg.qk_rope_head_dim, cfg.energy, cfg.rope_init)
    out = Path(out)
    summary = {"teacher": str(teacher_spec), "ranks": ranks, "qk_rope_head_dim": cfg.qk_rope_head_dim,
               "rope_init": cfg.rope_init, "students": {}}
    for kind in ("mla", cfg.linear_mixer):
        layer_kinds = [kind] * s["L"]
        student_cfg = student_config(teacher.config, layer_kinds, qk_rope_head_dim=cfg.qk_rope_head_dim,
                                     rope_init=cfg.rope_init, **ranks)
        torch.manual_seed(cfg.seed)
        student = HybridForCausalLM(student_cfg)
        info = init_student_from_teacher(student, teacher, layer_kinds, mla_options={"rope_init": cfg.rope_init})
        if kind != "mla" and cfg.calib_tokens:
            summary["calibration"] = _calibrate(student, teacher, tokenizer, layer_kinds, cfg.calib_sources,
                                                cfg.calib_tokens, cfg.calib_seq_len)
        target = out / f"{kind}_student"
        with atomic_directory(target, overwrite=overwrite) as tmp:
            set_generation_defaults(student, tokenizer)
            student.save_pretrained(tmp, remote_code=cfg.remote_code)
            save_tokenizer(tokenizer, tmp)
        if kind == "mla" and cfg.rope_init == "frequency_matched":
            summary["rope"] = {"rope_type": s["rope"]["rope_type"], **rope_mismatch(s, student_cfg.mla)}
            if summary["rope"]["mismatched"]:
                print(f"RoPE: {summary['rope']['mismatched']} of the {summary['rope']['pairs']} rotation pairs the MLA "
                      f"student keeps rotate at another frequency than the teacher's {s['rope']['rope_type']} RoPE "
                      f"(max relative error {summary['rope']['max_rel_err']:.3g})", flush=True)
        kv = kv_report(teacher.config, kv_layers(layer_kinds), ranks["kv_lora_rank"], cfg.qk_rope_head_dim,
                       layer_kinds=layer_kinds, mixer_args={kind: student_cfg.mixer_args(kind)})
        energy_kept = info["mla"]
        summary["students"][kind] = {
            "path": str(target), "params": sum(p.numel() for p in student.parameters()),
            "kv_values_per_token": kv["hybrid_values_per_token"],
            "teacher_kv_values_per_token": kv["teacher_values_per_token"], "kv_ratio": kv["ratio"],
            "state_values_per_sequence": kv["hybrid_state_values"],
            "min_energy_kept": ({k: min(e[k] for e in energy_kept.values()) for k in ("q_energy", "kv_energy")}
                                if energy_kept else None)}
        print(f"{kind} student -> {target}")
        print(format_kv_report(kv))
    write_json(out / "init_report.json", summary)
    return summary


def _calibrate(student, teacher, tokenizer, layer_kinds, sources, tokens, seq_len) -> dict:
    """Fit the linear student's output scales (on the GPU when there is one) and summarise the fit."""

    if isinstance(sources, str):
        sources = [sources]
    ids = calibration_batch(tokenizer, list(sources), int(tokens), int(seq_len))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher.to(device)
    student.to(device)
    try:
        per_layer = calibrate_student(student, teacher, ids, layer_kinds)
    finally:
        teacher.cpu()
        student.cpu()
    before = [r["rel_err_before"] for r in per_layer.values()]
    after = [r["rel_err_after"] for r in per_layer.values()]
    print(f"calibrated {len(per_layer)} mixers on {ids.numel()} tokens: relative error of the mixer output "
          f"{sum(before) / len(before):.3g} -> {sum(after) / len(after):.3g} (mean over layers)", flush=True)
    return {"sources": list(sources), "tokens": ids.numel(), "mean_rel_err_before": sum(before) / len(before),
            "mean_rel_err_after": sum(after) / len(after), "layers": per_layer}
