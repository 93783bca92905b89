"""Gated DeltaNet mixer: one scalar forget gate per value head, delta-rule state update, swish output gate.

Settings :class:`~hybridlm.model.layers.delta_rule.DeltaRuleArgs` (the ``gdn`` section of a config); the module,
its costs and its registry entry here; its upcycling from attention in ``upcycle/init_delta_rule.py``.
"""
from torch import nn

from hybridlm.model.layers.delta_rule import DeltaRuleArgs, DeltaRuleMixer, delta_rule_activations, delta_rule_costs
from hybridlm.model.registry import RECURRENT, register_mixer


class GatedDeltaNet(DeltaRuleMixer):
    gate_per_key_channel = False
    output_gate_activation = "swish"

    def build_gate_projections(self, d, args):
        self.a_proj = nn.Linear(d, self.num_v_heads, bias=False)
        self.g_proj = nn.Linear(d, self.value_dim, bias=False)

    def gate_projections(self):
        return self.a_proj, self.g_proj

    def gate_input(self, h):
        return h

    def output_gate(self, h):
        return h

    def triton_delta_rule(self, q, k, v, a, b, initial_state=None, output_final_state=False, qk_normalized=False):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        op = fused_recurrent_gated_delta_rule if initial_state is not None and q.shape[1] == 1 else chunk_gated_delta_rule
        return op(q=q, k=k, v=v, g=a, beta=b, scale=self.head_k_dim ** -0.5,
                  initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=not qk_normalized, use_beta_sigmoid_in_kernel=True,
                  use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)


GDN_COSTS = delta_rule_costs(lambda a: delta_rule_activations(a, gate_per_key_channel=False))

GDN = register_mixer("gdn", symbol="G", args=DeltaRuleArgs, module=GatedDeltaNet, cache=RECURRENT, save_unused=True,
                     costs=GDN_COSTS, title="GDN", from_attention="upcycle.init_delta_rule:GDN_FROM_ATTENTION")
