"""The memory and FLOP model of ``upcycle plan`` (upcycle/plan.py states it in full): parameter counts of the
teacher, both students and the hybrid on PyTorch's ``meta`` device, the activations the backward keeps, forward
FLOPs per token, a trained model's bytes under bf16 ZeRO-1, and :class:`PlanInputs`, what a stage's plan hook
(:class:`upcycle.stages.StageSpec` ``plan``) reads of them."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.kv_report import ATTENTION_KIND
from hybridlm.model import HybridForCausalLM
from hybridlm.model.layers.mixing_flops import causal_attention_flops
from hybridlm.model.registry import costs_of, is_mixer
from upcycle.student import llama_shapes, student_config

GIB = 1024 ** 3
BF16, FP32 = 2, 4


# ------------------------------------------------------------------------------------------ parameters
def _meta(build):
    with torch.device("meta"):
        return build()


def param_counts(model) -> Dict[str, int]:
    """``total``, ``layers`` (decoder blocks), ``outer`` (embeddings, final norm, LM head; a tied head once) and, of a
    hybrid, ``mixers`` (its mixer sublayers' own weights: what the align stage trains by default)."""
    total = sum(p.numel() for p in model.parameters())
    layers = sum(p.numel() for p in model.model.layers.parameters())
    mixers = sum(p.numel() for block in model.model.layers if is_mixer(getattr(block, "kind", ""))
                 for p in block.mixer.parameters())
    return {"total": total, "layers": layers, "outer": total - layers, "mixers": mixers}


def student_kinds(L: int, n_mla: int, linear: str) -> List[str]:
    """n_mla MLA layers spread over L (their places do not change any count), the rest ``linear``."""
    mla = {round(i * (L - 1) / max(n_mla - 1, 1)) for i in range(n_mla)} if n_mla else set()
    return [ATTENTION_KIND if i in mla else linear for i in range(L)]


def models(teacher_cfg, init, n_mla: int) -> Dict[str, Dict[str, Any]]:
    """Parameter counts and config of the teacher, both ILD students and the composed hybrid."""
    from transformers import LlamaForCausalLM

    s = llama_shapes(teacher_cfg)
    L, linear = s["L"], init.linear_mixer
    out = {"teacher": {"params": param_counts(_meta(lambda: LlamaForCausalLM(teacher_cfg))), "shapes": s}}
    for name, layer_kinds in ((f"{ATTENTION_KIND}_student", [ATTENTION_KIND] * L), (f"{linear}_student", [linear] * L),
                              ("hybrid", student_kinds(L, n_mla, linear))):
        cfg = student_config(teacher_cfg, layer_kinds, q_lora_rank=init.q_lora_rank, kv_lora_rank=init.kv_lora_rank,
                             qk_rope_head_dim=init.qk_rope_head_dim, rope_init=init.rope_init)
        out[name] = {"params": param_counts(_meta(lambda: HybridForCausalLM(cfg))), "layer_kinds": layer_kinds,
                     "config": cfg}
    return out


# ----------------------------------------------------------------------------------------- activations
def activation_widths(cfg, kind: str) -> Dict[str, float]:
    """Values per token the backward keeps of one decoder layer (pre-norm + mixer ``kind``, pre-norm + MLP),
    bf16 values, with fp32 tensors counted as two. See the module docstring."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    widths = costs_of(kind).activations
    if widths is None:
        raise ConfigError(f"plan: mixer {kind!r} has no activation model (MixerCosts.activations in its registry "
                          f"entry)")
    return {"mixer": 2 * d + widths(cfg.mixer_args(kind)), "mlp": 2 * d + 3 * f}


def activation_bytes(cfg, layer_kinds: Sequence[str], tokens: int, checkpointing: bool) -> int:
    """Bytes the backward keeps for one micro-batch of ``tokens`` tokens (b x s) through the decoder layers."""
    per_layer = [sum(activation_widths(cfg, k).values()) for k in layer_kinds]
    if checkpointing:
        return int(tokens * BF16 * (len(layer_kinds) * cfg.hidden_size + max(per_layer)))
    return int(tokens * BF16 * sum(per_layer))


# -------------------------------------------------------------------------------------------- FLOPs
def forward_flops_per_token(cfg, layer_kinds: Sequence[str], params: int, seq_len: int) -> float:
    """2 per parameter and each mixer's forward FLOPs beyond its weights (its registry entry)."""
    return 2.0 * params + sum(costs_of(k).flops(cfg.mixer_args(k), seq_len) for k in layer_kinds)


def teacher_forward_flops(shapes: Dict[str, Any], params: int, seq_len: int) -> float:
    s = shapes
    return 2.0 * params + s["L"] * causal_attention_flops(s["n_h"], s["d_h"], s["d_h"], seq_len)


# ------------------------------------------------------------------------------------------ per stage
@dataclasses.dataclass
class StagePlan:
    name: str
    ranks: int
    micro_batch: int
    seq_len: int
    tokens: int
    bytes: Dict[str, int]
    flops: float
    note: str = ""

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def trained_bytes(all_params: int, trainable: int, ranks: int) -> Dict[str, int]:
    """A trained model's bytes per rank under bf16 ZeRO-1 (see the module docstring)."""
    return {"student weights (bf16)": BF16 * all_params,
            "gradients (bf16 + fp32 accumulator)": (BF16 + FP32) * trainable,
            "master + Adam (fp32, ZeRO-1)": -(-(FP32 + 2 * FP32) * trainable // ranks)}


# -------------------------------------------------------------------------------------- a stage's inputs
@dataclasses.dataclass
class PlanModel:
    """One model of the route on the meta device: its :func:`param_counts`, config and layer kinds."""
    params: Dict[str, int]
    config: Any
    layer_kinds: List[str]

    def activations(self, tokens: int, checkpointing: bool) -> int:
        """:func:`activation_bytes` of one micro-batch of ``tokens`` tokens."""
        return activation_bytes(self.config, self.layer_kinds, tokens, checkpointing)

    def mixer_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of its mixers beyond their weights (:func:`forward_flops_per_token`)."""
        return forward_flops_per_token(self.config, self.layer_kinds, 0, seq_len)


@dataclasses.dataclass
class PlanInputs:
    """What a stage's plan hook reads: the teacher's counts and shapes, the two pure students (by kind: MLA
    first, then the linear mixer) and the composed hybrid."""
    teacher_params: int    # every parameter
    teacher_matmul: int    # less an untied input embedding (a lookup, not a matmul)
    lookup: int            # that embedding's parameters (0 when tied)
    shapes: Dict[str, Any]
    students: Dict[str, PlanModel]
    hybrid: PlanModel

    def teacher_flops(self, seq_len: int) -> float:
        """The frozen teacher's forward FLOPs per token (:func:`teacher_forward_flops`)."""
        return teacher_forward_flops(self.shapes, self.teacher_matmul, seq_len)


def plan_inputs(teacher_cfg, init, n_mla: int) -> PlanInputs:
    """The models of a route with ``init`` (its :class:`upcycle.init_students.InitConfig`) and ``n_mla`` MLA layers."""
    m = models(teacher_cfg, init, n_mla)
    shapes, T = m["teacher"]["shapes"], m["teacher"]["params"]["total"]
    lookup = 0 if shapes["tie"] else shapes["vocab"] * shapes["d"]
    model = lambda name: PlanModel(m[name]["params"], m[name]["config"], m[name]["layer_kinds"])
    return PlanInputs(T, T - lookup, lookup, shapes,
                      {kind: model(f"{kind}_student") for kind in (ATTENTION_KIND, init.linear_mixer)},
                      model("hybrid"))
