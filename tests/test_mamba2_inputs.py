"""Mamba2's SSD inputs (hybridlm/ops/mamba2_inputs.py): the torch.compile'd function against the eager one,
values and gradients, at a grouped shape with fewer x channels than heads need (d_xb). Slow: inductor compiles
C++ on a CPU (~20 s); the CUDA path's twin of this test is tests/gpu/test_mamba2_compile_gpu.py."""
import pytest
import torch

from hybridlm.ops.mamba2_inputs import compiled_ssd_inputs, ssd_inputs

pytestmark = pytest.mark.slow


def test_compiled_inputs_equal_the_eager_ones_with_gradients():
    torch.manual_seed(0)
    B, T, H, P, N, G, xb_heads = 2, 16, 8, 8, 4, 2, 4
    d_xb, d_b = xb_heads * P, G * N // (H // xb_heads)
    kw = dict(head_dim=P, d_state=N, n_groups=G)
    leaves = [torch.randn(B, T, d_xb), torch.randn(B, T, d_b), torch.randn(B, T, G * N), torch.randn(B, T, H),
              torch.randn(H), torch.randn(H)]
    weights = None
    results = []
    for fn in (ssd_inputs, compiled_ssd_inputs()):
        args = [t.clone().requires_grad_() for t in leaves]
        out = fn(*args, **kw)
        weights = weights or [torch.randn_like(o) for o in out]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), args)
        results.append(([o.detach() for o in out], grads))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert [tuple(o.shape) for o in eager] == [(B, T, H, P), (B, T, H, N), (B, T, H, N), (B, T, H)]
    for a, b in zip(compiled + list(compiled_grads), eager + list(eager_grads)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
