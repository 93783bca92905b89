"""KD-SFT: the student learns the frozen teacher's next-token distribution on chat data or general text.

Loss over the supervised (assistant) tokens, shifted like a causal LM (the logits at position t score
``labels[t + 1]``; positions whose target is -100 are left out)::

    loss = kl_weight * mean_t KL(p_teacher(. | <t) || p_student(. | <t)) + ce_weight * mean_t CE(student, label)

with both distributions softened by ``temperature`` inside the KL (the CE always at temperature 1). The KL
is a per-token mean in nats (the published code sums over the tokens of each sequence, so its loss starts
near 20,000); no T^2 factor is applied (fold one into ``kl_weight`` if wanted). Published settings: kl 1.0,
ce 0.0, temperature 1, lr 8e-5 cosine with 1% warmup, bf16, seq 2048; every student parameter trains
(end-to-end; embeddings and the tied LM head included).

The loss itself (chunked: the ``[tokens, vocab]`` logits never exist whole) is ``distill/kd_loss.py``; this
module is the stage: its ``kd:`` settings, its data and its runner. CLI (its declaration in ``upcycle/stages.py``)::

    upcycle kd --config configs/upcycle/smollm2_kd_cpu.yaml student.path=... run.output_dir=...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from distill.kd_loss import kd_loss
from distill.stage import amend_stage_result, packed_lm_batches, run_stage, stage_configs
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting, to_dict
from hybridlm.data import DataConfig
from hybridlm.data.document_windows import DocumentDataConfig, open_document_splits
from hybridlm.data.sft import SFTDataConfig, make_sft_batches

IGNORE_INDEX = -100
KD_SECTIONS = ("teacher", "student", "data", "optim", "run", "runtime", "kd")


# ------------------------------------------------------------------------------------- config
@dataclass
class KDConfig(Section):
    """The ``kd:`` section: loss weights, softmax temperature and the KL chunk size (tokens)."""

    kl_weight: float = setting(1.0, ge=0)
    ce_weight: float = setting(0.0, ge=0)
    temperature: float = setting(1.0, gt=0)
    chunk_tokens: int = setting(1024, ge=1)  # supervised tokens per logits chunk (memory: ~3 x chunk x vocab fp32)

    def validate(self, where: str = "kd") -> None:
        super().validate(where)
        if self.kl_weight == 0 and self.ce_weight == 0:
            raise ConfigError(f"{where}: kl_weight and ce_weight are both 0 (nothing to train on)")


# ------------------------------------------------------------------------------------- data
KD_DATA_FORMATS = ("chat", "packed", "documents")


class AlignedLabels:
    """Packed LM batches (labels = the next tokens) as KD batches (labels aligned with ``input_ids``, every
    token supervised); the wrapped iterator's resume state passes through."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        return aligned_labels(next(self.batches))

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state):
        self.batches.load_state_dict(state)

    def __getattr__(self, name):  # epoch sizes and the like, for the loop's progress line
        return getattr(self.batches, name)


def aligned_labels(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # kd_loss scores labels[t + 1] at position t, so the window's own ids are its aligned labels (the window's
    # last target is dropped: one token in seq_len)
    return {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}


def packed_kd_batches(data_cfg, optim, dist, tokenizer):
    train, val = packed_lm_batches(data_cfg, optim, dist, tokenizer)
    return AlignedLabels(train), [aligned_labels(b) for b in val]


def document_kd_batches(data_cfg, optim, dist, tokenizer):
    train, val = packed_lm_batches(data_cfg, optim, dist, tokenizer, splits=open_document_splits)
    return AlignedLabels(train), [aligned_labels(b) for b in val]


def kd_data(data_section: Optional[Dict[str, Any]], where: str = "kd.") -> Tuple[type, Dict[str, Any]]:
    """(dataclass, section without ``format``) of a KD ``data:`` section.

    ``format: chat`` (default): a chat / alpaca JSON file, the assistant tokens supervised. ``format: packed``:
    text sources packed into windows exactly like ILD's data (a :class:`hybridlm.data.DataConfig`), every token
    supervised: KD on general text keeps what the teacher knows beyond chat. ``format: documents``: the same packed
    data, each window inside one document (:mod:`hybridlm.data.document_windows`): a long-context stage."""
    section = dict(data_section or {})
    fmt = section.pop("format", "chat")
    if fmt not in KD_DATA_FORMATS:
        raise ConfigError(f"{where}data.format: {fmt!r} is not one of {', '.join(KD_DATA_FORMATS)}")
    return {"packed": DataConfig, "documents": DocumentDataConfig}.get(fmt, SFTDataConfig), section


# the batch source of each KD data section
KD_BATCHES = {DataConfig: packed_kd_batches, DocumentDataConfig: document_kd_batches, SFTDataConfig: make_sft_batches}


def kd_configs(sections: Dict[str, Any], where: str = "") -> Dict[str, Any]:
    """A KD stage's sections built (:func:`distill.stage.stage_configs`), its ``data`` by ``data.format``."""
    data_class, data = kd_data(sections.get("data"), where or "kd.")
    return stage_configs({**sections, "data": data}, data_class, {"kd": KDConfig}, where=where)


def run_kd(configs: Dict[str, Any]) -> Dict[str, Any]:
    """KD-SFT of the student directory with the built sections (:func:`kd_configs`; ``kd:`` is
    :class:`KDConfig`); every student parameter trains. Returns (and writes to ``final/stage.json``) the stage
    summary."""

    cfg = configs["kd"]
    make_batches = KD_BATCHES[type(configs["data"])]

    def make_loss(teacher):
        teacher.eval()
        return lambda student, batch: kd_loss(student, teacher, batch, cfg.kl_weight, cfg.ce_weight,
                                              cfg.temperature, cfg.chunk_tokens)

    result = run_stage("kd", configs, make_loss, lambda student: student.parameters(), make_batches=make_batches)
    return amend_stage_result(configs["run"].output_dir, {}, {"kd": to_dict(cfg)}, result)


