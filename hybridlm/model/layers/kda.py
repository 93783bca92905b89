"""Kimi Delta Attention mixer: a forget gate per key channel from a low-rank projection, sigmoid output gate.

Settings :class:`~hybridlm.model.layers.delta_rule.DeltaRuleArgs` (the ``kda`` section of a config); the module,
its costs and its registry entry here; its upcycling from attention in ``upcycle/init_delta_rule.py``.
"""
from torch import nn

from hybridlm.model.layers.delta_rule import DeltaRuleArgs, DeltaRuleMixer, delta_rule_activations, delta_rule_costs
from hybridlm.model.registry import RECURRENT, register_mixer


class KimiDeltaAttention(DeltaRuleMixer):
    gate_per_key_channel = True
    output_gate_activation = "sigmoid"

    def build_gate_projections(self, d, args):
        rank = args.gate_rank or self.head_v_dim  # fla uses head_v_dim as the bottleneck
        self.f_proj = nn.Sequential(nn.Linear(d, rank, bias=False),
                                    nn.Linear(rank, self.num_v_heads * self.head_k_dim, bias=False))
        self.g_proj = nn.Sequential(nn.Linear(d, rank, bias=False),
                                    nn.Linear(rank, self.value_dim, bias=True))

    def gate_projections(self):
        return self.f_proj[0], self.g_proj[0]

    def gate_input(self, h):
        return self.f_proj[1](h)

    def output_gate(self, h):
        return self.g_proj[1](h)

    def triton_delta_rule(self, q, k, v, a, b, initial_state=None, output_final_state=False, qk_normalized=False):
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        B, T = a.shape[:2]
        op = fused_recurrent_kda if initial_state is not None and T == 1 else chunk_kda
        return op(q=q, k=k, v=v, g=a.view(B, T, self.num_v_heads, self.head_k_dim), beta=b,
                  scale=self.head_k_dim ** -0.5, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=not qk_normalized, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  A_log=self.A_log, dt_bias=self.dt_bias)


# the gate's bottleneck defaults to head_v_dim, as build_gate_projections sets it
KDA_COSTS = delta_rule_costs(lambda a: delta_rule_activations(a, gate_per_key_channel=True,
                                                              gate_rank=a.gate_rank or a.head_v_dim))

KDA = register_mixer("kda", symbol="K", args=DeltaRuleArgs, module=KimiDeltaAttention, cache=RECURRENT,
                     save_unused=True, costs=KDA_COSTS, title="KDA",
                     from_attention="upcycle.init_delta_rule:KDA_FROM_ATTENTION")
