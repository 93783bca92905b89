"""The Mamba2 peer's chunked SSD (benchmarks/harness/peer_ssd.py) computes what transformers' reference SSD does."""
import math

import pytest
import torch

pytest.importorskip("transformers.models.mamba2")
from transformers import Mamba2Config, Mamba2ForCausalLM  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402

from benchmarks.harness import peer_ssd  # noqa: E402


@pytest.mark.parametrize("groups,with_state", [(1, False), (2, True), (4, False)])
def test_chunk_scan_matches_transformers_reference(groups, with_state):
    """Outputs and final states of the two scans agree in fp32: dt bias / softplus / clamp, each group serving
    consecutive heads, the D skip, an initial state."""
    torch.manual_seed(0)
    b, t, h, p, n = 2, 40, 4, 8, 16
    x = torch.randn(b, t, h, p)
    dt = torch.randn(b, t, h)
    A = -torch.rand(h) * 2 - 0.1
    B, C = torch.randn(b, t, groups, n), torch.randn(b, t, groups, n)
    D, dt_bias = torch.randn(h), torch.randn(h)
    init = torch.randn(b, h, p, n) if with_state else None
    kw = dict(chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 3.0),
              initial_states=init, return_final_states=True)
    ref_y, ref_state = modeling_mamba2.mamba2_chunk_scan(x, dt, A, B, C, **kw)
    y, state = peer_ssd.chunk_scan_via(peer_ssd.torch_gla_op)(x, dt, A, B, C, **kw)
    assert y.shape == ref_y.shape and torch.allclose(y, ref_y, atol=1e-4, rtol=1e-4)
    assert state.shape == ref_state.shape and torch.allclose(state, ref_state, atol=1e-4, rtol=1e-4)


def tiny_peer(seed=0):
    torch.manual_seed(seed)
    cfg = Mamba2Config(vocab_size=97, hidden_size=32, state_size=8, num_hidden_layers=2, head_dim=8, expand=2,
                       n_groups=2, num_heads=8, chunk_size=16, use_cache=False)
    return Mamba2ForCausalLM(cfg)


def test_whole_peer_same_loss_and_gradients_and_patch_is_undone():
    model = tiny_peer()
    ids = torch.randint(0, 97, (2, 48))
    check = peer_ssd.compare_on_batch(model, ids, peer_ssd.torch_gla_op, autocast=False)
    assert check["tensors"] == len(list(model.parameters()))
    assert check["loss_diff"] < 1e-5 and check["min_grad_cosine"] > 0.99999 and check["max_grad_rel_diff"] < 1e-3
    assert math.isfinite(check["reference_loss"])
    assert modeling_mamba2.mamba2_chunk_scan.__name__ == "mamba2_chunk_scan"  # the context restored it


def test_a_wrong_operator_is_caught():
    """The comparison can fail: an operator that forgets the decay gives another loss and other gradients."""
    def no_decay(q, k, v, g, s):
        return peer_ssd.torch_gla_op(q, k, v, torch.zeros_like(g), s)

    check = peer_ssd.compare_on_batch(tiny_peer(), torch.randint(0, 97, (2, 48)), no_decay, autocast=False)
    assert check["min_grad_cosine"] < 0.99 or check["loss_diff"] > 1e-3
