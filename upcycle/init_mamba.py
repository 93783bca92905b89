"""Initialise linear-time mixers (Mamba2, Gated DeltaNet, KDA) and a whole student from a Llama teacher.

MambaInLlama (docs/upcycling_init.md): attention's q / k / v / o play the roles of a linear recurrence's C / B / x / out.

* Mamba2 (shapes of :func:`upcycle.student.mamba2_args`: expand 1, d_inner = n_h d_h, d_xb = n_kv d_h,
  d_state = d_h, n_groups = n_h): ``in_proj`` rows ``[z | x | B | C | dt]`` get x <- W_v, B <- W_k,
  C <- W_q; ``out_proj`` <- W_o. x and B keep the teacher's n_kv heads; the layer repeats each across its
  GQA group after the conv (kv head j serves heads j*g .. j*g+g-1, exactly Llama's ``repeat_kv``).
  The dt rows keep their default init; A_log = log U(1, 16), dt_bias = softplus^-1(dt) with dt log-uniform
  in [1e-3, 1e-1] floored at 1e-4 and D = 1 are re-drawn by the layer's own initialisers. Unlike
  MambaInLlama, the conv starts as the identity and (with ``gate_bias``) the gate as the constant 1, and
  :mod:`upcycle.calibrate` then fits the gated norm's weight to the teacher's output scale: the published
  init is worse than a uniform guess before training (docs/upcycling_init.md).
* GDN / KDA (shapes of :func:`upcycle.student.delta_rule_args`: n_h heads of d_h for q, k and v):
  q_proj <- W_q, k_proj / v_proj <- W_k / W_v with each kv head repeated across its GQA group,
  o_proj <- W_o; the rest (convs, beta, decay and output gates) keeps its default init, the decay
  parameters and output-norm weight re-drawn by the layer's initialisers.

:func:`init_student_from_teacher` copies everything else that the student shares with the teacher:
embeddings, final norm, LM head, every MLP and both RMSNorms of every layer; MLA layers go to
:func:`upcycle.init_mla.init_mla_from_attention`.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from hybridlm.model.layers import GatedDeltaNet, KimiDeltaAttention, Mamba2
from upcycle.init_mla import init_mla_from_attention
from upcycle.teacher_attention import attention_shapes, attention_weights

LINEAR_KINDS = ("mamba2", "gdn", "kda")


def repeat_kv_rows(w: torch.Tensor, n_kv: int, n_h: int) -> torch.Tensor:
    """``[n_kv d_h, d]`` -> ``[n_h d_h, d]``: kv head j becomes query heads j*g .. j*g+g-1 (g = n_h / n_kv)."""
    d_h = w.shape[0] // n_kv
    return w.reshape(n_kv, d_h, w.shape[1]).repeat_interleave(n_h // n_kv, dim=0).reshape(n_h * d_h, w.shape[1])


def _expect(kind: str, what: str, got, want) -> None:
    if got != want:
        raise ValueError(f"{kind} init from attention: {what} is {got}, the teacher needs {want} "
                         f"(build the student with upcycle.student.student_config)")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


SILU_INVERSE_OF_ONE = 1.2784645  # silu(1.2784645) = 1.0


def set_conv_identity(conv) -> None:
    """A depthwise causal kernel that passes the current token through unchanged (before the SiLU)."""
    conv.weight.zero_()
    conv.weight[:, -1] = 1.0
    if conv.bias is not None:
        conv.bias.zero_()


# ------------------------------------------------------------------------------------------ mixers
@torch.no_grad()
def init_mamba2_from_attention(mixer, attn) -> None:
    s = attention_shapes(attn)
    w = attention_weights(attn)
    n_h, n_kv, d_h = s["n_h"], s["n_kv"], s["d_h"]
    _expect("mamba2", "hidden size", mixer.in_proj.in_features, s["d"])
    _expect("mamba2", "head_dim", mixer.head_dim, d_h)
    _expect("mamba2", "d_state", mixer.d_state, d_h)
    _expect("mamba2", "num heads (d_inner / head_dim)", mixer.num_heads, n_h)
    _expect("mamba2", "n_groups", mixer.n_groups, n_h)
    _expect("mamba2", "d_xb", mixer.d_xb, n_kv * d_h)
    _expect("mamba2", "B width before repetition", mixer.d_b, n_kv * d_h)
    for lin, name in ((mixer.in_proj, "in_proj"), (mixer.out_proj, "out_proj")):
        if lin.bias is not None:
            raise ValueError(f"mamba2 init from attention: {name} has a bias, expected none")
    z, x, b, c, dt = mixer.in_proj.weight.split(
        [mixer.d_inner, mixer.d_xb, mixer.d_b, mixer.n_groups * mixer.d_state, mixer.num_heads], dim=0)
    _copy(x, w["v"])
    _copy(b, w["k"])
    _copy(c, w["q"])
    _copy(mixer.out_proj.weight, w["o"])
    mixer.reset_recurrent_parameters()   # A_log, dt_bias, D
    mixer.norm_weight.fill_(1.0)         # upcycle.calibrate fits it to the teacher's output scale
    # A random conv kernel mixes each channel of x / B / C with its neighbours in time and a random z scrambles
    # the output direction; both made the copied attention useless (docs/upcycling_init.md). The conv starts
    # as the identity on the current token, the gate as the constant silu(z_bias) = 1 with z's weights zero.
    set_conv_identity(mixer.conv1d)
    if mixer.z_bias is not None:
        z.zero_()
        mixer.z_bias.fill_(SILU_INVERSE_OF_ONE)


@torch.no_grad()
def init_delta_rule_from_attention(mixer, attn, kind: str = "gdn") -> None:
    s = attention_shapes(attn)
    w = attention_weights(attn)
    n_h, n_kv, d_h = s["n_h"], s["n_kv"], s["d_h"]
    _expect(kind, "hidden size", mixer.q_proj.in_features, s["d"])
    _expect(kind, "num_heads", mixer.num_heads, n_h)
    _expect(kind, "head_dim", mixer.head_k_dim, d_h)
    _expect(kind, "num_v_heads", mixer.num_v_heads, n_h)
    _expect(kind, "head_v_dim", mixer.head_v_dim, d_h)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if getattr(mixer, name).bias is not None:
            raise ValueError(f"{kind} init from attention: {name} has a bias, expected none")
    _copy(mixer.q_proj.weight, w["q"])
    _copy(mixer.k_proj.weight, repeat_kv_rows(w["k"], n_kv, n_h))
    _copy(mixer.v_proj.weight, repeat_kv_rows(w["v"], n_kv, n_h))
    _copy(mixer.o_proj.weight, w["o"])
    mixer.reset_recurrent_parameters()   # A_log, dt_bias
    mixer.o_norm_weight.fill_(1.0)


def init_linear_mixer_from_attention(mixer, attn, kind: str) -> None:
    """Copy a Llama attention's q / k / v / o into a Mamba2 / GDN / KDA ``mixer`` in place (MambaInLlama).

    ``kind`` is ``mamba2 | gdn | kda`` and must match the mixer's class; any shape that does not fit the
    teacher's heads raises ValueError."""

    classes = {"mamba2": Mamba2, "gdn": GatedDeltaNet, "kda": KimiDeltaAttention}
    if kind not in classes:
        raise ValueError(f"kind: {kind!r} is not a linear mixer; expected one of {', '.join(LINEAR_KINDS)}")
    if not isinstance(mixer, classes[kind]):
        raise ValueError(f"kind {kind!r} expects a {classes[kind].__name__}, got {type(mixer).__name__}")
    if kind == "mamba2":
        init_mamba2_from_attention(mixer, attn)
    else:
        init_delta_rule_from_attention(mixer, attn, kind)


# ------------------------------------------------------------------------------------ whole student
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
    _copy(s_emb, t_emb)
    _copy_same(student.model.norm.weight, teacher.model.norm.weight, "final norm")
    s_head, t_head = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight
    if s_head is s_emb:
        if t_head is not t_emb and not torch.equal(t_head.detach().cpu(), t_emb.detach().cpu()):
            raise ValueError("lm_head: the student ties it to the embeddings but the teacher's differs")
    else:
        _copy_same(s_head, t_head, "lm_head")

    mla_opts = dict(mla_options or {})
    report: Dict[str, Any] = {"mla": {}}
    for i, (kind, t_layer) in enumerate(zip(kinds, t_layers)):
        mixer_block, mlp_block = s_blocks[2 * i], s_blocks[2 * i + 1]
        _copy_same(mixer_block.norm.weight, t_layer.input_layernorm.weight, f"layer {i} input_layernorm")
        _copy_same(mlp_block.norm.weight, t_layer.post_attention_layernorm.weight,
                   f"layer {i} post_attention_layernorm")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if getattr(t_layer.mlp, name).bias is not None:
                raise ValueError(f"layer {i} {name}: the teacher's MLP has a bias; the student's SwiGLU has none")
            _copy_same(getattr(mlp_block.mixer, name).weight, getattr(t_layer.mlp, name).weight, f"layer {i} {name}")
        attn = t_layer.self_attn
        if kind == "mla":
            report["mla"][i] = _call_mla_init(mixer_block.mixer, attn, attention_shapes(attn)["n_kv"], mla_opts)
        else:
            init_linear_mixer_from_attention(mixer_block.mixer, attn, kind)
    return report


def _copy_same(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: student shape {tuple(dst.shape)} vs teacher {tuple(src.shape)}")
    _copy(dst, src.detach())
