"""transformers' Mamba2 peer normalises as ``--peer-norm`` says, whatever transformers is installed
(benchmarks/harness/peer_norm.py).

transformers before 5.24 normalised the gated RMSNorm over all of d_inner; mamba_ssm, ours and transformers 5.24 over
groups of d_inner / n_groups. With n_groups > 1 the two are different functions of the same weights.
"""
import types

import pytest
import torch

from conftest import tiny_config
from benchmarks.harness import loss_parity as LP
from benchmarks.harness.peer_norm import grouped_gated_rms_norm, set_gated_norms
from benchmarks.harness.peer_weights import load_peer_weights
from hybridlm.model import HybridForCausalLM
from hybridlm.ops.elementwise import gated_rms_norm

pytest.importorskip("transformers.models.mamba2")


def test_grouped_forward_is_transformers_and_ours():
    torch.manual_seed(0)
    y, z = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    norm = types.SimpleNamespace(weight=torch.rand(64) + 0.5, variance_epsilon=1e-6, group_size=16)
    got = grouped_gated_rms_norm(norm, y, z)
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
    ref = MambaRMSNormGated(64, group_size=16, eps=1e-6)
    ref.weight.data.copy_(norm.weight)
    torch.testing.assert_close(got, ref(y, z), rtol=0, atol=0)
    ours = gated_rms_norm(y, z, norm.weight, 1e-6, activation="swish", norm_before_gate=False, group_size=16,
                          triton=False)
    torch.testing.assert_close(got, ours, rtol=1e-5, atol=1e-6)
    # one group of all 64 channels: the old transformers' formula, written out
    norm.group_size = 64
    h = y * torch.nn.functional.silu(z)
    old = norm.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(grouped_gated_rms_norm(norm, y, z), old)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["grouped", "d_inner"])
def test_the_peer_is_ours_with_the_grouped_norm_only(kind, seeded):
    cfg = tiny_config("MMM", "mamba2", mamba2=dict(d_state=16, head_dim=16, n_groups=4, expand=2))
    args = types.SimpleNamespace(seq=64, peer_chunk_size=16, peer_init="fla", peer_norm=kind)
    peer, info = LP.build_peer("hf", "mamba2", cfg, 0, args)
    assert info["norm"] == kind
    ours = HybridForCausalLM(cfg)
    load_peer_weights(ours, peer, "hf", "mamba2")
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    diff = (peer.eval()(input_ids=ids).logits - ours.eval()(input_ids=ids).logits).abs().max().item()
    if kind == "grouped":
        assert diff < 1e-4
    else:  # 4 groups normalised as one: not the same model
        assert diff > 1e-2
    with pytest.raises(ValueError, match="expected one of"):
        set_gated_norms(peer, "layer")
