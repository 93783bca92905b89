"""Hidden-state alignment: the composed hybrid's residual stream matched to the teacher's, layer by layer, with
only the mixers training, before end-to-end KD matches the logits (MOHAWK / Llamba, arXiv 2502.14458; the
alignment stage of fla-org/hybrid-distillation, arXiv 2512.20569).

ILD trains each layer of the two pure students on the teacher's input to that layer. Once SMART's choice is
composed, the hybrid's layers have never run one after another: ``stream: student`` (default) runs the hybrid
on its own residual stream, so the error a layer passes on is what the later layers are trained against;
``stream: teacher`` feeds every layer the teacher's input (ILD's teacher forcing, on the hybrid's mixers). With
``h_i`` the student's and ``g_i`` the teacher's residual stream after decoder layer ``i`` (L layers)::

    mse:    loss = mean_i  mean_t ||h_i - g_i||^2 / mean_t ||g_i||^2     (each layer counts alike, whatever its scale)
    cosine: loss = mean_i  mean_t (1 - cos(h_i, g_i))

The parameter groups in ``align.train`` train (distill/param_groups.py; default the linear mixers and MLA); the
MLPs, norms, embeddings and head stay as the teacher left them. CLI::

    upcycle align --config configs/upcycle/smollm2_align_cpu.yaml student.path=... run.output_dir=...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch

from distill.ild import teacher_trace
from distill.param_groups import GROUPS, student_param_groups
from distill.stage import amend_stage_result, run_stage, stage_configs
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting, to_dict

ALIGN_SECTIONS = ("teacher", "student", "data", "optim", "run", "runtime", "align")
LOSSES = ("mse", "cosine")
STREAMS = ("student", "teacher")


@dataclass
class AlignConfig(Section):
    """The ``align:`` section: the distance, whose residual stream feeds each layer, the groups that train."""

    loss: str = setting("mse", choices=LOSSES)
    stream: str = setting("student", choices=STREAMS)
    train: List[str] = field(default_factory=lambda: ["mixer", "latent"])

    def validate(self, where: str = "align") -> None:
        super().validate(where)
        bad = [g for g in self.train if g not in GROUPS]
        if bad or not self.train:
            raise ConfigError(f"{where}.train: expected a non-empty list of {', '.join(GROUPS)}, got {self.train!r}")


def layer_distance(h: torch.Tensor, g: torch.Tensor, loss: str) -> torch.Tensor:
    """One layer's term (module docstring), in fp32."""
    h, g = h.float(), g.float()
    if loss == "mse":
        return (h - g).pow(2).sum(-1).mean() / g.pow(2).sum(-1).mean().clamp_min(1e-12)
    return (1 - torch.nn.functional.cosine_similarity(h, g, dim=-1)).mean()


def align_loss(student, teacher, input_ids: torch.LongTensor, loss: str = "mse",
               stream: str = "student") -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The mean over decoder layers of :func:`layer_distance` (module docstring); metrics: the first and the
    last layer's term and the largest."""
    blocks = student.model.layers
    trace = teacher_trace(teacher, input_ids)
    if len(blocks) != 2 * len(trace):
        raise ValueError(f"align: the student has {len(blocks)} sublayers, the teacher {len(trace)} layers "
                         f"(expected 2 per layer)")
    dtype = next(student.parameters()).dtype
    h = student.model.embed_tokens(input_ids)
    terms = []
    for i, (x, _, y) in enumerate(trace):
        if stream == "teacher":
            h = x.to(dtype)
        h = blocks[2 * i + 1](blocks[2 * i](h))
        terms.append(layer_distance(h, y, loss))
    stacked = torch.stack(terms)
    detached = stacked.detach()
    return stacked.mean(), {"first_layer": detached[0], "last_layer": detached[-1], "worst_layer": detached.max()}


def align_configs(sections: Dict[str, Any], where: str = "") -> Dict[str, Any]:
    """An align stage's sections built (:func:`distill.stage.stage_configs`; its data is packed text, as ILD's)."""
    return stage_configs(sections, extra={"align": AlignConfig}, where=where)


def run_align(configs: Dict[str, Any]) -> Dict[str, Any]:
    """Hidden-state alignment of the student directory with the built sections (:func:`align_configs`); only the
    groups of ``align.train`` train. Returns (and writes to ``final/stage.json``) the stage summary."""
    cfg = configs["align"]

    def make_loss(teacher):
        teacher.eval()
        return lambda student, batch: align_loss(student, teacher, batch["input_ids"], cfg.loss, cfg.stream)

    def trainable(student):
        groups = student_param_groups(student, student.parameters())
        return [p for name in cfg.train for p in groups[name]]

    result = run_stage("align", configs, make_loss, trainable)
    return amend_stage_result(configs["run"].output_dir, {}, {"align": to_dict(cfg)}, result)
