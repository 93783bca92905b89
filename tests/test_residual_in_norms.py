"""Residual adds inside the norms (``hybridlm.ops.backend.residual_adds_in_norms``, ``runtime.graph_fuse_residual``):
the model computes the same function with each block's residual add left to the next norm, CPU.

1. The torch path: bitwise the blocks' output (full forward and cached decode, fp32 and bf16, every sublayer kind);
   a hooked block keeps the block loop; the switch reaches a captured step's context.
2. fla's fused norm with a residual input, through the Triton interpreter (``TRITON_INTERPRET=1``, a subprocess):
   a tiny hybrid whose norms all take fla's kernel decodes the same greedy tokens with and without the residual
   adds in the norms, logits to fp32 rounding, and both agree with the torch path.
"""
import contextlib
import json
import sys

import pytest
import torch

from conftest import greedy_decode, run_under_interpreter, tiny_config
from hybridlm.model import HybridForCausalLM
from hybridlm.model.cache import HybridCache
from hybridlm.model.graphs import GraphedDecoder
from hybridlm.ops.backend import residual_adds_in_norms, residual_adds_in_norms_active

NEW = 5


def _model(pattern="*-G-K-S-M-", mixer="gdn", dtype=torch.float32):
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config(pattern, mixer=mixer)).eval()
    with torch.no_grad():  # norm weights off 1, so that which norm sees which input matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(dtype)


def _decode(model, ids, fused):
    with torch.no_grad(), (residual_adds_in_norms() if fused else contextlib.nullcontext()):
        full = model(input_ids=ids).logits
        tokens, logits, _, _ = greedy_decode(model, ids, NEW)
    return full, tokens, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_path_is_bitwise_the_blocks_function(dtype):
    model = _model(dtype=dtype)
    ids = torch.randint(1, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    base, fused = _decode(model, ids, False), _decode(model, ids, True)
    for a, b in zip(base, fused):
        assert torch.equal(a, b)


def test_a_hooked_block_keeps_the_block_loop():
    """A hook on a block (ILD, probes) sees the block's own input and output, switch or not."""
    model = _model()
    seen = []
    model.model.layers[2].register_forward_hook(lambda mod, args, out: seen.append(out.clone()))
    ids = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(2))
    base, fused = _decode(model, ids, False), _decode(model, ids, True)
    assert torch.equal(base[0], fused[0])
    calls = NEW + 1  # the full forward, the prompt's and NEW - 1 steps
    assert len(seen) == 2 * calls and all(torch.equal(a, b) for a, b in zip(seen[:calls], seen[calls:]))


def test_the_switch_reaches_a_captured_steps_context():
    """The decoder reads its model's runtime when it captures: a ``set_runtime`` after it was built counts."""
    model = _model()
    decoder = GraphedDecoder(model, HybridCache(model.config, max_length=4, batch_size=1, dtype=torch.float32))
    assert model.runtime.graph_fuse_residual  # on by default since measured on a GPU
    with decoder.kernel_choices():
        assert residual_adds_in_norms_active()
    assert not residual_adds_in_norms_active()
    model.set_runtime(graph_fuse_residual=False)
    with decoder.kernel_choices():
        assert not residual_adds_in_norms_active()


# ------------------------------------------------------------------ the interpreter run (a subprocess)

def run_fla_norms() -> dict:
    """The tiny hybrid's norms through fla's kernel (its Triton path forced for every RMSNorm), decoded with and
    without the residual adds in the norms, against the torch path."""
    from hybridlm.model.layers import norm as N
    model = _model("*-M-S-", mixer="mamba2")
    ids = torch.randint(1, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    calls = []
    fla_norm = N.add_rms_norm

    def counted(*a, **k):
        calls.append(k.get("triton"))
        return fla_norm(*a, **k)

    torch_path = _decode(model, ids, False)
    N.use_triton_elementwise, N.add_rms_norm = (lambda backend, x: True), counted
    unfused, fused = _decode(model, ids, False), _decode(model, ids, True)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()
    return {"fused_kernel_calls": sum(1 for t in calls if t), "same_tokens": torch.equal(fused[1], unfused[1]),
            "same_tokens_as_torch": torch.equal(fused[1], torch_path[1]),
            "full": rel(fused[0], unfused[0]), "decode": rel(fused[2], unfused[2]),
            "full_vs_torch": rel(fused[0], torch_path[0]), "decode_vs_torch": rel(fused[2], torch_path[2])}


def test_fla_fused_norm_decodes_the_same_in_the_interpreter():
    r = run_under_interpreter({"fla_norms": [sys.executable, __file__]})["fla_norms"]
    # 6 blocks: 5 of their norms and the final one take the residual, in the prompt's forward and every step
    assert r["fused_kernel_calls"] == 6 * NEW + 6, r  # + the full forward
    assert r["same_tokens"] and r["same_tokens_as_torch"], r
    for key in ("full", "decode", "full_vs_torch", "decode_vs_torch"):
        assert r[key] < 1e-5, (key, r)


if __name__ == "__main__":  # python tests/test_residual_in_norms.py -> one JSON line (TRITON_INTERPRET=1)
    from tests.support import fla_interpret
    fla_interpret.enable()
    print(json.dumps(run_fla_norms()))
