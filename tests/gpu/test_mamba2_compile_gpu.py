"""Mamba2's training forward and backward with its SSD inputs through torch.compile (runtime.compile_ssd_inputs,
hybridlm/ops/mamba2_inputs.py) against the eager ops, on the Triton path at the 300M shape (needs CUDA)."""
import dataclasses

import pytest
import torch

from benchmarks.harness.mixers import SHAPES_300M
from hybridlm.model import HybridConfig
from hybridlm.model.layers import build_sublayer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_inputs_train_like_the_eager_ones(dtype):
    cfg = HybridConfig(**{**SHAPES_300M, "vocab_size": 4096, "hybrid_override_pattern": "M-", "mixer": "mamba2"})
    torch.manual_seed(0)
    layer = build_sublayer(cfg, "mamba2").cuda().to(dtype)
    x = torch.randn(2, 512, cfg.hidden_size, device="cuda", dtype=dtype)
    results = []
    for compiled in (False, True):
        layer.runtime = dataclasses.replace(layer.runtime, compile_ssd_inputs=compiled)
        layer.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out.float().square().mean().backward()
        results.append([out.detach(), inp.grad] + [p.grad for p in layer.parameters()])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for eager, compiled in zip(*results):
        err = ((compiled.double() - eager.double()).norm() / eager.double().norm().clamp_min(1e-30)).item()
        assert err < tol, err
