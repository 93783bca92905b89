"""Shared body of the two delta-rule mixers (Gated DeltaNet, Kimi Delta Attention).

x -> q, k, v projections -> depthwise causal conv + SiLU -> L2-normalised q, k; beta = sigmoid(b_proj x [+ b_bias]);
a log-decay gate g <= 0 -> gated delta rule -> per-head gated RMSNorm (gate: the output-gate projection
[+ g_bias]) -> o_proj. The two biases exist with ``gate_bias`` / ``beta_bias`` (upcycled layers).
Subclasses define the gate (scalar per head for GDN, per key channel for KDA) and the output gate.
Grouped value heads (num_v_heads a multiple of num_heads) share each q/k head, as in fla.

With an :class:`~hybridlm.model.cache.InferenceContext` (generation) the convs and the recurrence continue
from the layer's cached states: a prompt goes through the chunked form, one new token through the
recurrent step. Padded positions get a zero input: the q/k/v projections and convs have no bias, so q, k, v
are exactly 0 there and the state does not move (the decay multiplies a zero state under left padding).

Their settings (:class:`DeltaRuleArgs`, the ``gdn`` and ``kda`` sections of a config) and costs live here; each
mixer's file holds its module and its registry entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.config.errors import ConfigError
from hybridlm.model.layers.conv import ShortConv, recurrent_context, run_short_conv, split_conv_applies
from hybridlm.model.layers.init import init_A_log, init_dt_bias
from hybridlm.model.layers.mixing_flops import CHUNK_SIZE, delta_rule_flops
from hybridlm.model.layers.projections import project
from hybridlm.model.registry import MixerCosts, check_divides, check_positive
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.ops.backend import use_triton, use_triton_elementwise
from hybridlm.ops.causal_conv import HeadNorm, can_split, causal_conv_split
from hybridlm.ops.chunked_recurrence import chunk_gated_recurrence, gated_recurrence_with_state, l2_normalize
from hybridlm.ops.elementwise import gated_rms_norm
from hybridlm.ops.gradient_slots import gradient_slot


@dataclass
class DeltaRuleArgs:
    num_heads: int = 4
    head_dim: Optional[int] = None     # default hidden_size / num_heads
    num_v_heads: Optional[int] = None  # default num_heads; a multiple of num_heads (grouped value heads)
    head_v_dim: Optional[int] = None   # default head_dim
    conv_size: int = 4
    norm_eps: float = 1e-6
    gate_rank: Optional[int] = None    # KDA only: low-rank gate bottleneck, default head_v_dim
    # learned biases on the output gate's and on beta's input: let a layer upcycled from attention start with a
    # constant gate and a small beta (docs/upcycling_init.md); off for models trained from scratch, as in fla
    gate_bias: bool = False
    beta_bias: bool = False

    def finalize(self, hidden: int, where: str) -> None:
        check_positive(self, where, ("num_heads", "head_dim", "num_v_heads", "head_v_dim", "conv_size", "gate_rank"))
        if self.head_dim is None:
            check_divides(f"{where}.num_heads", "num_heads", self.num_heads, "hidden_size", hidden)
            self.head_dim = hidden // self.num_heads
        self.num_v_heads = self.num_v_heads or self.num_heads
        self.head_v_dim = self.head_v_dim or self.head_dim
        if self.num_v_heads % self.num_heads:
            raise ConfigError(f"{where}.num_v_heads: {self.num_v_heads} is not a multiple of num_heads {self.num_heads}")
        if self.conv_size < 1:
            raise ConfigError(f"{where}.conv_size: must be >= 1, got {self.conv_size}")


class DeltaRuleMixer(nn.Module):
    gate_per_key_channel: bool = False  # KDA: True
    output_gate_activation: str = "swish"
    chunk_size: int = 64  # torch path's chunk length (tests shrink it)

    def __init__(self, args: DeltaRuleArgs, hidden_size: int, layer_idx: int = 0,
                 runtime: Optional[RuntimeSettings] = None):
        """``args``: finalized settings (``args.finalize(hidden_size, kind)``); ``runtime``: the model's settings,
        read when it runs (None: the defaults)."""
        super().__init__()
        d = hidden_size
        self.layer_idx = layer_idx
        self.runtime = RuntimeSettings() if runtime is None else runtime  # model.set_runtime replaces it
        self.num_heads, self.head_k_dim = args.num_heads, args.head_dim
        self.num_v_heads, self.head_v_dim = args.num_v_heads, args.head_v_dim
        self.key_dim = self.num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.norm_eps = args.norm_eps
        self.q_proj = nn.Linear(d, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d, self.value_dim, bias=False)
        self.q_conv1d = ShortConv(self.key_dim, args.conv_size)
        self.k_conv1d = ShortConv(self.key_dim, args.conv_size)
        self.v_conv1d = ShortConv(self.value_dim, args.conv_size)
        self.b_proj = nn.Linear(d, self.num_v_heads, bias=False)
        gate_dim = self.num_v_heads * (self.head_k_dim if self.gate_per_key_channel else 1)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(gate_dim))
        for p in (self.A_log, self.dt_bias):
            p._no_weight_decay = True
        self.build_gate_projections(d, args)
        # optional biases added after the projections (the fused projection GEMM stays bias-free)
        self.g_bias = nn.Parameter(torch.zeros(self.value_dim)) if args.gate_bias else None
        self.b_bias = nn.Parameter(torch.zeros(self.num_v_heads)) if args.beta_bias else None
        for p in (self.g_bias, self.b_bias):
            if p is not None:
                p._no_weight_decay = True
        self.o_norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)
        self.reset_recurrent_parameters()

    def cache_shapes(self) -> dict:
        """Per-sequence shapes of this layer's generation cache: the recurrent state and the q / k / v convs."""
        return {"state": (self.num_v_heads, self.head_k_dim, self.head_v_dim),
                "conv": {"q": self.q_conv1d.state_shape, "k": self.k_conv1d.state_shape,
                         "v": self.v_conv1d.state_shape}}

    # -- subclass hooks ------------------------------------------------------------------------
    def build_gate_projections(self, d: int, args) -> None:
        raise NotImplementedError

    def gate_projections(self) -> tuple:
        """The first linear of the decay gate and of the output gate (each reads the mixer's input)."""
        raise NotImplementedError

    def gate_input(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-activation decay input, ``[B, T, HV]`` or ``[B, T, HV * K]``, from the first gate linear's output."""
        raise NotImplementedError

    def output_gate(self, h: torch.Tensor) -> torch.Tensor:
        """The output gate's pre-activation from the first output-gate linear's output."""
        raise NotImplementedError

    def triton_delta_rule(self, q, k, v, a, b, initial_state=None, output_final_state=False, qk_normalized=False):
        """fla's kernel with the gate, L2 norms (unless ``qk_normalized``: done in the conv) and sigmoid fused in;
        returns ``(o, final state or None)``. One token continuing a state goes through the fused recurrent
        kernel."""
        raise NotImplementedError

    # -------------------------------------------------------------------------------------------
    def reset_recurrent_parameters(self) -> None:
        init_A_log(self.A_log, 1.0 if self.gate_per_key_channel else 1e-9, 16.0)
        init_dt_bias(self.dt_bias)

    def log_decay(self, a: torch.Tensor) -> torch.Tensor:
        """g = -exp(A_log) * softplus(a + dt_bias), in fp32, shaped for the recurrence."""
        B, T = a.shape[:2]
        a = a.float().view(B, T, self.num_v_heads, -1) + self.dt_bias.float().view(self.num_v_heads, -1)
        g = -self.A_log.float().exp().view(-1, 1) * F.softplus(a)
        return g if self.gate_per_key_channel else g.squeeze(-1)

    def qk_head_norm(self) -> HeadNorm:
        """q and k's heads normalised as fla normalises them, each repeated for the value heads that share it."""
        return HeadNorm(segments=2, head_dim=self.head_k_dim, repeat=self.num_v_heads // self.num_heads)

    def projected_inputs(self, x: torch.Tensor, triton: bool, cache=None) -> tuple:
        """``((q, k, v, b, a, z), qk_normalized)``: the six projections, q / k / v through their short convs
        (continuing from the cache's conv states in generation). In training one GEMM for the six
        (hybridlm/model/layers/projections.py), and with ``split_conv_outputs`` one conv kernel over q | k | v where
        they lie side by side in its output, writing each as its own contiguous tensor (hybridlm/ops/causal_conv.py
        ``causal_conv_split``); with ``qk_norm_in_conv`` too, that conv L2-normalises q and k and writes each head
        once per value head that shares it (``qk_normalized`` then True: the recurrence takes them as they are).
        With ``projection_grads_in_place`` the GEMM's output gradient is assembled where the conv and the output
        norm write theirs (hybridlm/ops/gradient_slots.py)."""
        linears = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self.gate_projections())
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        join = (split_conv_applies(self.runtime, triton, cache)
                and len({c.bias is None for c in convs}) == 1)
        in_place = self.runtime.projection_grads_in_place and triton and cache is None
        outputs = project(x, linears, fuse=self.runtime.fuse_projections, join_first=3 if join else 1,
                          grads_in_place=in_place)
        if len(outputs) == len(linears) - 2:  # q | k | v as one view (the fused GEMM ran: training)
            qkv, *rest = outputs
            bias = None if convs[0].bias is None else torch.cat([c.bias for c in convs])
            widths = [c.weight.shape[0] for c in convs]
            head_norm = self.qk_head_norm()
            normalise = self.runtime.qk_norm_in_conv and can_split(widths, head_norm)
            return (*causal_conv_split(qkv, torch.cat([c.weight for c in convs]), bias, widths,
                                       grad_slot=gradient_slot(qkv), head_norm=head_norm if normalise else None),
                    *rest), normalise
        q, k, v, *rest = outputs
        conv_kernel = self.runtime.conv_kernel
        return (*(run_short_conv(c, t, triton, cache, name, conv_kernel)
                  for c, t, name in zip(convs, (q, k, v), "qkv")), *rest), False

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        B, T, _ = x.shape
        triton = use_triton(self.runtime.backend, x)
        cache, x = recurrent_context(ctx, self.layer_idx, x)
        (q, k, v, b, a, z), qk_normalized = self.projected_inputs(x, triton, cache)
        qk_heads = self.num_v_heads if qk_normalized else self.num_heads  # normalised: one per value head
        q = q.view(B, T, qk_heads, self.head_k_dim)
        k = k.view(B, T, qk_heads, self.head_k_dim)
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)
        # fused, a and b are column slices of one tensor; fla's kernels index them as contiguous [B, T, HV(, K)]
        a, b = self.gate_input(a).contiguous(), b.contiguous()
        if self.b_bias is not None:
            b = b + self.b_bias.to(b.dtype)
        state = None if cache is None else cache.state
        if triton:
            o, state = self.triton_delta_rule(q, k, v, a, b, initial_state=state, output_final_state=cache is not None,
                                              qk_normalized=qk_normalized)
        else:
            groups = self.num_v_heads // self.num_heads
            q, k = (l2_normalize(t.float()) for t in (q, k))
            if groups > 1:
                q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
            g, beta, scale = self.log_decay(a), torch.sigmoid(b.float()), self.head_k_dim ** -0.5
            if cache is None:
                o, _ = chunk_gated_recurrence(q, k, v, g, beta, scale=scale, chunk_size=self.chunk_size)
            else:
                o, state = gated_recurrence_with_state(q, k, v, g, beta, scale, state, self.chunk_size)
        if cache is not None:
            cache.advance(state, T)
        gate = self.output_gate(z)
        if self.g_bias is not None:
            gate = gate + self.g_bias.to(gate.dtype)
        z_slot = gradient_slot(z) if gate is z else None  # z's gradient written in place (gradient_slots.py)
        o = gated_rms_norm(o, gate.view(B, T, self.num_v_heads, self.head_v_dim), self.o_norm_weight, self.norm_eps,
                           activation=self.output_gate_activation,
                           triton=triton and use_triton_elementwise(self.runtime.backend, o), z_grad_slot=z_slot,
                           norm_kernel=self.runtime.norm_kernel)
        return self.o_proj(o.reshape(B, T, self.value_dim).to(x.dtype))


# ------------------------------------------------------------------------------------- registry costs
def delta_rule_mixer_flops(a, seq_len: int) -> float:
    """The chunked gated delta rule over the value heads; independent of the context length."""
    return delta_rule_flops(a.num_v_heads, a.head_dim, a.head_v_dim)


def delta_rule_state(a) -> int:
    """The state (value heads x head_dim x head_v_dim) and the q / k / v convs' last conv_size inputs."""
    key_dim, value_dim = a.num_heads * a.head_dim, a.num_v_heads * a.head_v_dim
    return a.num_v_heads * a.head_dim * a.head_v_dim + (2 * key_dim + value_dim) * a.conv_size


def delta_rule_activations(a, gate_per_key_channel: bool, gate_rank: int = 0) -> float:
    """q / k / v before and after their convs, q and k L2-normalised for the value heads, beta and the decay
    gate's input, the output gate, the recurrence and gated-norm outputs, ``gate_rank``'s two low-rank
    bottlenecks, and the fp32 chunk states (one value heads x head_dim x head_v_dim state per chunk)."""
    key_dim, value_dim, hv = a.num_heads * a.head_dim, a.num_v_heads * a.head_v_dim, a.num_v_heads
    decay = hv * (a.head_dim if gate_per_key_channel else 1)
    states = 2 * hv * a.head_dim * a.head_v_dim / CHUNK_SIZE
    return (2 * (2 * key_dim + value_dim) + 2 * hv * a.head_dim + hv + decay + 3 * value_dim + 2 * gate_rank
            + states)


def delta_rule_costs(activations) -> MixerCosts:
    """The registry costs of a delta-rule mixer whose activation widths are ``activations(args)``."""
    return MixerCosts(flops=delta_rule_mixer_flops, state_per_sequence=delta_rule_state, activations=activations)
