"""A whole student initialised in place from its Llama teacher.

Copies everything the student shares with the teacher (embeddings, final norm, LM head, every MLP and both
RMSNorms of every layer) and initialises each mixer from its layer's attention: MLA layers by
:func:`upcycle.init_mla.init_mla_from_attention`, linear mixers by
:func:`upcycle.init_linear.init_linear_mixer_from_attention`.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from upcycle.init_copy import copy_into, copy_same
from upcycle.init_linear import init_linear_mixer_from_attention
from upcycle.init_mla import init_mla_from_attention
from upcycle.teacher_attention import attention_shapes


def _call_mla_init(mixer, attn, n_kv: int, options: Mapping[str, Any]):
    opts = dict(options)
    try:
        params = inspect.signature(init_mla_from_attention).parameters
        if "n_kv" in params and "n_kv" not in opts:
            opts["n_kv"] = n_kv
    except (TypeError, ValueError):
        pass
    return init_mla_from_attention(mixer, attn, **opts)


@torch.no_grad()
def init_student_from_teacher(student, teacher, layer_kinds: Sequence[str],
                              mla_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Initialise a ``HybridForCausalLM`` ``student`` (built by :func:`upcycle.student.student_config` with
    ``layer_kinds``) from a ``LlamaForCausalLM`` ``teacher``, in place.

    Copies embeddings, the final norm, the LM head (when the student's is untied), every MLP
    (gate / up / down) and both RMSNorms of each layer (input_layernorm -> sublayer 2i's norm,
    post_attention_layernorm -> sublayer 2i+1's norm); initialises each mixer from the layer's attention
    (:func:`init_linear_mixer_from_attention`, or ``upcycle.init_mla.init_mla_from_attention(mixer, attn,
    **mla_options)`` for ``mla``; ``n_kv`` is filled in when that function takes it).
    Returns ``{"mla": {layer: whatever the MLA init returned}}``."""
    t_layers = teacher.model.layers
    s_blocks = student.model.layers
    kinds: List[str] = list(layer_kinds)
    if len(kinds) != len(t_layers):
        raise ValueError(f"layer_kinds: {len(kinds)} kinds for a teacher with {len(t_layers)} layers")
    if len(s_blocks) != 2 * len(t_layers):
        raise ValueError(f"student: {len(s_blocks)} sublayers, expected {2 * len(t_layers)} "
                         f"(mixer + MLP per teacher layer)")
    for i, kind in enumerate(kinds):
        got = (s_blocks[2 * i].kind, s_blocks[2 * i + 1].kind)
        if got != (kind, "mlp"):
            raise ValueError(f"student layer {i}: sublayers are {got}, layer_kinds says ({kind!r}, 'mlp')")

    s_emb, t_emb = student.get_input_embeddings().weight, teacher.get_input_embeddings().weight
    if s_emb.shape != t_emb.shape:
        raise ValueError(f"embeddings: student {tuple(s_emb.shape)} vs teacher {tuple(t_emb.shape)}")
    copy_into(s_emb, t_emb)
    copy_same(student.model.norm.weight, teacher.model.norm.weight, "final norm")
    s_head, t_head = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight
    if s_head is s_emb:
        if t_head is not t_emb and not torch.equal(t_head.detach().cpu(), t_emb.detach().cpu()):
            raise ValueError("lm_head: the student ties it to the embeddings but the teacher's differs")
    else:
        copy_same(s_head, t_head, "lm_head")

    mla_opts = dict(mla_options or {})
    report: Dict[str, Any] = {"mla": {}}
    for i, (kind, t_layer) in enumerate(zip(kinds, t_layers)):
        mixer_block, mlp_block = s_blocks[2 * i], s_blocks[2 * i + 1]
        copy_same(mixer_block.norm.weight, t_layer.input_layernorm.weight, f"layer {i} input_layernorm")
        copy_same(mlp_block.norm.weight, t_layer.post_attention_layernorm.weight,
                   f"layer {i} post_attention_layernorm")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if getattr(t_layer.mlp, name).bias is not None:
                raise ValueError(f"layer {i} {name}: the teacher's MLP has a bias; the student's SwiGLU has none")
            copy_same(getattr(mlp_block.mixer, name).weight, getattr(t_layer.mlp, name).weight, f"layer {i} {name}")
        attn = t_layer.self_attn
        if kind == "mla":
            report["mla"][i] = _call_mla_init(mixer_block.mixer, attn, attention_shapes(attn)["n_kv"], mla_opts)
        else:
            init_linear_mixer_from_attention(mixer_block.mixer, attn, kind)
    return report
