"""MLA's split-K decode attention (hybridlm/ops/latent_decode.py), CPU.

1. The torch twin against the layer's SDPA path (``MultiHeadLatentAttention._attend_absorbed``' math): the same
   attention, fp32.
2. The Triton kernels through the interpreter (``TRITON_INTERPRET=1``, a subprocess) against the twin: fp32 and
   bf16, several splits (one, some, more than needed), batch masks and a shared one, a fully masked split, two query
   tokens (a causal mask), no mask.
3. A tiny ``*-M-`` hybrid decoding with its MLA layers on the kernel (in the interpreter) against SDPA: the same greedy
   tokens, static cache (CUDA-graph buffers) and a left-padded dynamic batch.
"""
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import greedy_decode, run_under_interpreter, tiny_config
from hybridlm.ops.latent_decode import latent_attention_decode_reference

# (batch, heads, T, latent, rope, keys, n_splits, mask kind, dtype)
KERNEL_CASES = [
    (2, 3, 1, 32, 16, 300, None, "batch", "float32"),
    (2, 3, 1, 32, 16, 300, 3, "batch", "float32"),
    (2, 3, 1, 32, 16, 300, 1, "batch", "float32"),
    (1, 4, 1, 64, 8, 200, 50, "shared", "float32"),      # more splits than keys allow: clamped
    (2, 2, 2, 16, 16, 130, 2, "causal", "float32"),      # two query tokens
    (2, 3, 1, 32, 16, 257, 4, "none", "float32"),
    (2, 3, 1, 32, 16, 300, 3, "batch", "bfloat16"),
]


def _inputs(B, H, T, R, RO, S, kind, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * T, R + RO, generator=g)
    kv = torch.randn(B, S, R + RO, generator=g)
    valid = torch.tensor([S - 50, S - 1][:B])                       # static-cache slots written so far, per row
    keys = torch.arange(S)
    if kind == "batch":  # row 1 also left-padded: its first 20 keys masked, and a whole split beyond `valid`
        mask = (keys[None, None, :] <= valid[:, None, None]).clone()
        mask[-1, :, :20] = False
    elif kind == "shared":
        mask = (keys <= S // 2)[None, None, :]
    elif kind == "causal":  # query t sees keys up to S - T + t
        mask = keys[None, None, :] <= (S - T + torch.arange(T))[None, :, None]
        mask = mask.expand(B, T, S)
    else:
        mask = None
    dt = getattr(torch, dtype)
    return q.to(dt), kv.to(dt), mask


def test_twin_is_the_layers_sdpa_attention():
    B, H, T, R, RO, S = 2, 3, 2, 32, 16, 70
    q, kv, mask = _inputs(B, H, T, R, RO, S, "causal", "float32", 0)
    got = latent_attention_decode_reference(q, kv, mask, 0.2, R, T)
    # _attend_absorbed's SDPA: heads folded into the query length, kv as key and value, rope columns dropped
    sdpa_mask = mask.unsqueeze(1).repeat(1, H, 1, 1).reshape(B, 1, H * T, S)
    want = F.scaled_dot_product_attention(q.unsqueeze(1), kv.unsqueeze(1), kv.unsqueeze(1), attn_mask=sdpa_mask,
                                          scale=0.2)[:, 0, :, :R]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_named():
    from hybridlm.ops.latent_decode import latent_attention_decode
    q, kv, mask = _inputs(2, 3, 1, 32, 16, 40, "batch", "float32", 0)
    with pytest.raises(ValueError, match="kv"):
        latent_attention_decode(q, kv[:, :, :40], mask, 0.1, 32)
    with pytest.raises(ValueError, match="mask"):
        latent_attention_decode(q, kv, mask.float(), 0.1, 32)
    with pytest.raises(ValueError, match="dtype"):
        latent_attention_decode(q, kv.bfloat16(), mask, 0.1, 32)


# ------------------------------------------------------------------ the interpreter runs (a subprocess)

def run_kernel_cases() -> list:
    from hybridlm.ops.latent_decode import latent_attention_decode
    rows = []
    for seed, (B, H, T, R, RO, S, splits, kind, dtype) in enumerate(KERNEL_CASES):
        q, kv, mask = _inputs(B, H, T, R, RO, S, kind, dtype, seed)
        got = latent_attention_decode(q, kv, mask, 0.15, R, T, splits)
        want = latent_attention_decode_reference(q, kv, mask, 0.15, R, T)
        rows.append({"case": [B, H, T, R, RO, S, splits, kind, dtype], "dtype_ok": got.dtype == q.dtype,
                     "shape_ok": list(got.shape) == [B, H * T, R],
                     "err": ((got.double() - want.double()).norm() / want.double().norm()).item()})
    return rows


NEW = 4


def run_model_cases() -> dict:
    """Greedy decoding of a tiny ``*-M-`` hybrid with MLA's absorbed attention through SDPA and through the kernel
    (forced on for the CPU tensors of the interpreter)."""
    from hybridlm.model import HybridForCausalLM
    from hybridlm.model.cache import HybridCache
    from hybridlm.model.layers import mla as L

    calls = []
    kernel = L.latent_attention_decode

    def counted(*a, **k):
        calls.append(1)
        return kernel(*a, **k)

    def decode(model, ids, static, mask=None):
        B, T = ids.shape
        cache = (HybridCache(model.config, max_length=T + NEW - 1, batch_size=B, dtype=torch.float32, device="cpu")
                 if static else None)
        return greedy_decode(model, ids, NEW, cache, mask)[:2]

    out = {}
    with torch.no_grad():
        torch.manual_seed(0)
        model = HybridForCausalLM(tiny_config("*-M-", mixer="mamba2")).eval()
        ids = torch.randint(1, 512, (2, 7), generator=torch.Generator().manual_seed(1))
        pad = torch.ones_like(ids)
        pad[0, :3] = 0
        for scenario, kw in {"static": dict(static=True), "padded": dict(static=False, mask=pad)}.items():
            base = decode(model, ids, **kw)
            saved = L.MultiHeadLatentAttention._use_split_k, L.latent_attention_decode
            L.MultiHeadLatentAttention._use_split_k = lambda self, q, kv: not torch.is_grad_enabled()
            L.latent_attention_decode = counted
            calls.clear()
            try:
                got = decode(model, ids, **kw)
            finally:
                L.MultiHeadLatentAttention._use_split_k, L.latent_attention_decode = saved
            out[scenario] = {"same_tokens": torch.equal(got[0], base[0]), "kernel_calls": len(calls),
                             "logits": ((got[1] - base[1]).norm() / base[1].norm()).item()}
    return out


@pytest.fixture(scope="module")
def interpreter_runs():
    return run_under_interpreter({mode: [sys.executable, __file__, mode] for mode in ("kernel", "model")})


def test_kernel_equals_the_twin_in_the_interpreter(interpreter_runs):
    rows = interpreter_runs["kernel"]
    assert len(rows) == len(KERNEL_CASES)
    for r in rows:
        assert r["dtype_ok"] and r["shape_ok"], r
        assert r["err"] < (1e-5 if r["case"][-1] == "float32" else 1e-2), r


def test_tiny_model_decodes_the_same_through_the_kernel(interpreter_runs):
    runs = interpreter_runs["model"]
    assert set(runs) == {"static", "padded"}
    for key, r in runs.items():
        assert r["kernel_calls"] == NEW - 1, (key, r)  # one MLA layer, every decode step
        assert r["same_tokens"] and r["logits"] < 1e-5, (key, r)


if __name__ == "__main__":  # python tests/test_latent_decode.py kernel|model -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases() if sys.argv[1] == "kernel" else run_model_cases()))
