"""Mamba2 mixer without ``mamba_ssm``.

in_proj -> [z | x | B | C | dt]; depthwise causal conv + SiLU over [x | B | C]; dt = softplus(dt + dt_bias);
the SSD scan; + D * x skip; RMSNorm(y * silu(z)) per group; out_proj. With ``gate_bias`` z gets a learned
bias (used by upcycled layers, which start with a constant gate).

The SSD with scalar decay per head equals simple gated linear attention with q = C, k = dt * B, v = x,
log-decay g = A * dt (A = -exp(A_log)) and scale 1, so the Triton path is fla's ``chunk_simple_gla`` and
the torch path is :func:`hybridlm.ops.chunked_recurrence.chunk_gated_recurrence` without a delta rule.
``d_xb`` (MambaInLlama) projects x and B to fewer channels and repeats them across heads after the conv,
mirroring grouped-query attention.

With an :class:`~hybridlm.model.cache.InferenceContext` (generation) the conv and the SSD continue from the
layer's cached states (chunked form for a prompt, recurrent step for one token). Padding is zeroed at the
input (in_proj has no bias, so the conv sees zeros) and again after the conv, whose bias would otherwise
put non-zero B and x into the state.

This file is the whole mixer: its settings (:class:`Mamba2Args`, the ``mamba2`` section of a config), the
module, its costs, its init and its registry entry; the entry names its upcycling from attention
(``upcycle/init_mamba2.py``) and its vLLM twin (``hybridlm/serve``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from hybridlm.model.layers.conv import ShortConv, recurrent_context, run_short_conv, split_conv_applies
from hybridlm.model.layers.init import init_A_log, init_dt_bias, init_residual_out_proj, init_short_conv_uniform
from hybridlm.model.layers.mixing_flops import CHUNK_SIZE, simple_gla_flops
from hybridlm.model.registry import RECURRENT, MixerCosts, check_divides, check_positive, register_mixer
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.ops.backend import use_triton, use_triton_elementwise
from hybridlm.ops.causal_conv import causal_conv_split
from hybridlm.ops.chunked_recurrence import chunk_gated_recurrence, gated_recurrence_with_state
from hybridlm.ops.elementwise import skip_gated_rms_norm
from hybridlm.ops.gradient_slots import gradient_slot, split_columns
from hybridlm.ops.mamba2_inputs import compiled_ssd_inputs, repeat_heads, ssd_inputs
from hybridlm.ops.mamba2_step import mamba2_decode_step


@dataclass
class Mamba2Args:
    d_state: int = 64
    head_dim: int = 64
    n_groups: int = 8
    expand: int = 2
    d_inner: Optional[int] = None  # default expand * hidden_size
    d_xb: Optional[int] = None     # MambaInLlama: x / B width before repeating across heads
    conv_size: int = 4
    conv_bias: bool = True
    norm_eps: float = 1e-6
    # a learned bias on the output gate's input z: lets an upcycled layer start with a constant gate
    # (docs/upcycling_init.md); off for models trained from scratch, as in Mamba2
    gate_bias: bool = False

    def finalize(self, hidden: int, where: str) -> None:
        check_positive(self, where, ("d_state", "head_dim", "n_groups", "expand", "d_inner", "d_xb", "conv_size"))
        self.d_inner = self.d_inner or self.expand * hidden
        check_divides(f"{where}.head_dim", "head_dim", self.head_dim, "d_inner", self.d_inner)
        n_heads = self.d_inner // self.head_dim
        check_divides(f"{where}.n_groups", "n_groups", self.n_groups, "the number of heads", n_heads)
        if self.d_xb is not None:
            check_divides(f"{where}.d_xb", "d_xb", self.d_xb, "d_inner", self.d_inner)
            check_divides(f"{where}.d_xb", "head_dim", self.head_dim, "d_xb", self.d_xb)
            check_divides(f"{where}.d_xb", "d_inner / d_xb", self.d_inner // self.d_xb,
                          "n_groups * d_state", self.n_groups * self.d_state)


class Mamba2(nn.Module):
    chunk_size: int = 64  # torch path's chunk length (tests shrink it)

    def __init__(self, args: Mamba2Args, hidden_size: int, layer_idx: int = 0,
                 runtime: Optional[RuntimeSettings] = None):
        """``args``: finalized settings (``args.finalize(hidden_size, "mamba2")``); ``runtime``: the model's settings,
        read when it runs (None: the defaults)."""
        super().__init__()
        a, d = args, hidden_size
        self.layer_idx = layer_idx
        self.runtime = RuntimeSettings() if runtime is None else runtime  # model.set_runtime replaces it
        self.d_inner = a.expand * d if a.d_inner is None else a.d_inner
        self.head_dim, self.d_state, self.n_groups = a.head_dim, a.d_state, a.n_groups
        self.num_heads = self.d_inner // self.head_dim
        self.d_xb = self.d_inner if a.d_xb is None else a.d_xb  # x and B width before repetition
        self.xb_repeat = self.d_inner // self.d_xb
        self.d_b = self.n_groups * self.d_state // self.xb_repeat  # B channels before repetition
        self.norm_eps = a.norm_eps
        self.conv_dim = self.d_xb + self.d_b + self.n_groups * self.d_state
        self.in_proj = nn.Linear(d, self.d_inner + self.conv_dim + self.num_heads, bias=False)
        self.conv1d = ShortConv(self.conv_dim, a.conv_size, bias=a.conv_bias)
        init_short_conv_uniform(self.conv1d)  # not fla's small normal: it starves the SSD (layers/init.py)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner))
        self.z_bias = nn.Parameter(torch.zeros(self.d_inner)) if a.gate_bias else None
        if self.z_bias is not None:
            self.z_bias._no_weight_decay = True
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)
        self.reset_recurrent_parameters()

    def cache_shapes(self) -> dict:
        """Per-sequence shapes of this layer's generation cache: the SSD state and the conv over x, B, C."""
        return {"state": (self.num_heads, self.d_state, self.head_dim), "conv": {"conv": self.conv1d.state_shape}}

    def reset_recurrent_parameters(self) -> None:
        init_A_log(self.A_log)
        init_dt_bias(self.dt_bias)
        with torch.no_grad():
            self.D.fill_(1.0)

    def _repeat_heads(self, t: torch.Tensor, groups: int, per_head: int) -> torch.Tensor:
        """[B, T, groups * per_head] -> [B, T, num_heads, per_head] (:func:`hybridlm.ops.mamba2_inputs.repeat_heads`)."""
        return repeat_heads(t, groups, per_head, self.num_heads)

    def forward(self, hidden: torch.Tensor, ctx=None) -> torch.Tensor:
        Bsz, T, _ = hidden.shape
        triton = use_triton(self.runtime.backend, hidden)
        cache, hidden = recurrent_context(ctx, self.layer_idx, hidden)
        if triton and T == 1 and self._can_fuse_step(cache):
            return self._fused_step(hidden, ctx, cache)
        z, xbc, dt = self._project(hidden, triton, cache)
        if self.z_bias is not None:
            z = z + self.z_bias.to(z.dtype)
        x, b, c = self._convolve(xbc, triton, cache, ctx)
        inputs = compiled_ssd_inputs() if self._compile_inputs(triton) else ssd_inputs
        x, c, k, g = inputs(x, b, c, dt, self.dt_bias, self.A_log, head_dim=self.head_dim, d_state=self.d_state,
                            n_groups=self.n_groups)   # [B,T,H,P], [B,T,H,N] x 2, [B,T,H]
        if triton:
            y, state = self._triton_ssd(c, k, x, g, cache)
        elif cache is None:
            y, _ = chunk_gated_recurrence(c, k, x, g, beta=None, scale=1.0, chunk_size=self.chunk_size)
        else:
            y, state = gated_recurrence_with_state(c, k, x, g, None, 1.0, cache.state, self.chunk_size)
        if cache is not None:
            cache.advance(state, T)
        y = skip_gated_rms_norm(y.reshape(Bsz, T, self.d_inner), x.reshape(Bsz, T, self.d_inner), self.D, z,
                                self.norm_weight, self.norm_eps, group_size=self.d_inner // self.n_groups,
                                triton=triton and use_triton_elementwise(self.runtime.backend, y), z_grad_slot=gradient_slot(z),
                                norm_kernel=self.runtime.norm_kernel)
        return self.out_proj(y.to(hidden.dtype))

    def _project(self, hidden: torch.Tensor, triton: bool, cache) -> list:
        """``[z, xbc, dt]``, in_proj's column blocks. In training with ``projection_grads_in_place`` its output
        gradient is assembled where the conv and the output norm write theirs (hybridlm/ops/gradient_slots.py)."""
        widths = [self.d_inner, self.conv_dim, self.num_heads]
        if self.runtime.projection_grads_in_place and triton and cache is None and torch.is_grad_enabled():
            return split_columns(self.in_proj(hidden), widths)[0]
        return list(self.in_proj(hidden).split(widths, dim=-1))

    def _convolve(self, xbc: torch.Tensor, triton: bool, cache, ctx) -> tuple:
        """x, B and C after the conv + SiLU over ``xbc = [x | B | C]``. In training with ``split_conv_outputs``,
        each written as its own contiguous tensor (hybridlm/ops/causal_conv.py ``causal_conv_split``): fla's scan
        (its ``input_guard``) copies a non-contiguous input first, and x as a column block of one output is one:
        without the split, one more full read and write of x in every layer, a copy kernel (BENCHMARKS.md,
        "Training step breakdown")."""
        widths = (self.d_xb, self.d_b, self.n_groups * self.d_state)
        if split_conv_applies(self.runtime, triton, cache):
            return causal_conv_split(xbc, self.conv1d.weight, self.conv1d.bias, widths, grad_slot=gradient_slot(xbc))
        xbc = run_short_conv(self.conv1d, xbc, triton, cache, conv_kernel=self.runtime.conv_kernel)
        if ctx is not None:
            xbc = ctx.zero_padding(xbc)
        return xbc.split(widths, dim=-1)

    def _compile_inputs(self, triton: bool) -> bool:
        """Training on the Triton path (one shape a run; generation's prompt lengths would recompile)."""
        return self.runtime.compile_ssd_inputs and triton and torch.is_grad_enabled()

    def _can_fuse_step(self, cache) -> bool:
        """``runtime.mamba2_fused_step``, a decode token continuing cached states (a one-token prompt has none yet:
        the chunked path starts them), outside autograd (the fused kernel has no backward)."""
        return (self.runtime.mamba2_fused_step and cache is not None and cache.state is not None
                and cache.state.dtype == torch.float32 and "conv" in cache.conv_states
                and not torch.is_grad_enabled())

    def _fused_step(self, hidden: torch.Tensor, ctx, cache) -> torch.Tensor:
        """Everything between in_proj and out_proj of one cached token in one Triton kernel
        (:func:`hybridlm.ops.mamba2_step.mamba2_decode_step`), the conv and SSD states updated in place."""
        z, xbc, dt = self.in_proj(hidden)[:, 0].split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        y = mamba2_decode_step(
            z, xbc, dt, cache.conv_states["conv"], cache.state, self.conv1d.weight, self.conv1d.bias, self.dt_bias,
            self.A_log, self.D, self.norm_weight, self.z_bias, head_dim=self.head_dim, d_state=self.d_state,
            n_groups=self.n_groups, d_xb=self.d_xb, norm_eps=self.norm_eps,
            keep=None if ctx.key_mask is None else ctx.key_mask[:, -1])
        if not cache.static:  # the states are the same tensors, updated in place: only the token count moves
            cache.advance(cache.state, 1)
        return self.out_proj(y.to(hidden.dtype).unsqueeze(1))

    @staticmethod
    def _triton_ssd(c, b, v, g, cache):
        """fla's simple GLA; one token continuing a cached state goes through the fused recurrent kernel."""
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
        state = None if cache is None else cache.state
        op = fused_recurrent_simple_gla if state is not None and v.shape[1] == 1 else chunk_simple_gla
        return op(q=c, k=b, v=v, g=g, scale=1.0, initial_state=state, output_final_state=cache is not None)


# ------------------------------------------------------------------------------------- registry costs
def _widths(a):
    """(heads, conv channels: x, B before repetition and C) of finalized settings, as the layer builds them."""
    heads, d_xb = a.d_inner // a.head_dim, a.d_xb or a.d_inner
    d_b = a.n_groups * a.d_state // (a.d_inner // d_xb)
    return heads, d_xb + d_b + a.n_groups * a.d_state


def mamba2_flops(a, seq_len: int) -> float:
    """The chunked SSD (simple GLA with K = d_state, V = head_dim); independent of the context length."""
    return simple_gla_flops(a.d_inner // a.head_dim, a.d_state, a.head_dim)


def mamba2_state(a) -> int:
    """The SSD state (heads x d_state x head_dim) and the conv's last conv_size inputs of x, B, C."""
    heads, conv = _widths(a)
    return heads * a.d_state * a.head_dim + conv * a.conv_size


def mamba2_activations(a) -> float:
    """in_proj's output (z, x B C, dt), the conv output, x and B repeated to the heads, the SSD output and the
    gated-norm output, and the fp32 chunk states (one heads x head_dim x d_state state per chunk)."""
    heads, conv = _widths(a)
    states = 2 * heads * a.head_dim * a.d_state / CHUNK_SIZE
    return (a.d_inner + conv + heads) + conv + 2 * a.d_inner + 2 * a.d_inner + states


MAMBA2_COSTS = MixerCosts(flops=mamba2_flops, state_per_sequence=mamba2_state, activations=mamba2_activations)


def init_mamba2(module: Mamba2, config) -> None:
    """Mamba2's out_proj depth-scaled as in fla's Mamba2 (every sublayer adds to the residual stream: fla's
    num_hidden_layers for a pure Mamba2 stack, mamba_ssm's 2 x n_layer with MLPs) and its conv at PyTorch's
    Conv1d default as in mamba_ssm, not fla's small normal."""
    init_residual_out_proj(module.out_proj, len(config.layer_plan))
    init_short_conv_uniform(module.conv1d)


MAMBA2 = register_mixer("mamba2", symbol="S", args=Mamba2Args, module=Mamba2, cache=RECURRENT, init=init_mamba2,
                        save_unused=True, costs=MAMBA2_COSTS, title="Mamba2",
                        from_attention="upcycle.init_mamba2:FROM_ATTENTION",
                        serve_layer="hybridlm.serve.model:ServedMamba2",
                        serve_weights="hybridlm.serve.mapping:mamba2_weights")
