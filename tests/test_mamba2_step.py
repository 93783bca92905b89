"""The fused Mamba2 decode step (hybridlm/ops/mamba2_step.py), CPU.

1. Its torch twin against the layer's composed one-token cached path (``Mamba2.forward``, torch backend):
   output and both updated states, several shapes (norm groups, MambaInLlama's x / B repetition, one group,
   z bias, no conv bias), padded rows, fp32 and bf16.
2. The Triton kernel through the interpreter (``TRITON_INTERPRET=1``, a subprocess) against the twin: fp32
   to ~1e-6, and bf16 exactly (rounding point by point as the composed path does) once the interpreter's
   fp32 -> bf16 cast rounds to nearest even as compiled Triton does (the interpreter truncates: see
   ``conftest.interpreter_rounds_like_gpu``).
3. A tiny hybrid decoding through the kernel (its Mamba2 layers forced onto the Triton path for one-token
   steps, in the interpreter) against the same model's unfused CPU path: the same greedy tokens, dynamic and
   static cache (the static buffers keep their addresses), and a left-padded batch with a padded decode token.

Both subprocesses run at once (about 15 s each on a 2-core CPU).
"""
import contextlib
import json
import sys

import pytest
import torch

from conftest import greedy_decode, interpreter_rounds_like_gpu, run_under_interpreter, tiny_config
from hybridlm.model.cache import HybridCache, InferenceContext
from hybridlm.model.layers import build_sublayer
from hybridlm.ops.mamba2_step import mamba2_decode_step_reference

# Mamba2 shapes at hidden 64: (heads, norm groups, xb_repeat, B groups = programs per row)
LAYER_CONFIGS = {
    "groups": dict(d_state=16, head_dim=16, n_groups=2, expand=2),                            # 8, 2, 1, 2
    "xb_repeat": dict(d_state=16, head_dim=16, n_groups=4, expand=2, d_xb=64, gate_bias=True),  # 8, 4, 2, 2
    "one_b_group": dict(d_state=16, head_dim=16, n_groups=4, expand=1, d_xb=16, gate_bias=True,
                        conv_bias=False),                                                        # 4, 4, 4, 1
    "one_group": dict(d_state=8, head_dim=8, n_groups=1, expand=2, conv_size=3, conv_bias=False),  # 16, 1, 1, 1
}


def _layer(args, dtype=torch.float32, seed=0):
    cfg = tiny_config("M-", mixer="mamba2", mamba2=args)
    torch.manual_seed(seed)
    layer = build_sublayer(cfg, "mamba2")
    with torch.no_grad():  # every parameter off its init (gates, norms, biases at no special value)
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * (0.5 * p.std() if p.numel() > 1 and p.std() > 1e-3 else 0.3))
    return cfg, layer.to(dtype).eval()


def _cache(cfg, layer, batch, past, dtype, seed=1):
    """A dynamic cache whose Mamba2 entry holds random states, as after ``past`` tokens."""
    g = torch.Generator().manual_seed(seed)
    cache = HybridCache(cfg)
    entry = cache.layers[0]
    entry.state = torch.randn(batch, layer.num_heads, layer.d_state, layer.head_dim, generator=g) * 0.5
    entry.conv_states = {"conv": torch.randn(batch, *layer.conv1d.state_shape, generator=g).to(dtype)}
    entry.seen_tokens = past
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
@torch.no_grad()
def test_twin_equals_the_layers_cached_step(name, padded, dtype):
    cfg, layer = _layer(LAYER_CONFIGS[name], dtype)
    B, past = 3, 5
    cache = _cache(cfg, layer, B, past, dtype)
    entry = cache.layers[0]
    conv0, state0 = entry.conv_states["conv"].clone(), entry.state.clone()
    hidden = torch.randn(B, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    mask = torch.ones(B, past + 1, dtype=torch.long)
    if padded:
        mask[0, :2] = 0   # a left-padded row
        mask[1, -1] = 0   # a row whose new token is padding
        hidden[1] = float("nan")  # zero_padding uses where: padding may hold anything
    ctx = InferenceContext.build(cache, mask, None, 1, hidden.device)
    want = layer(hidden, ctx)
    assert entry.seen_tokens == past + 1

    ctx = InferenceContext.build(_cache(cfg, layer, B, past, dtype), mask, None, 1, hidden.device)
    z, xbc, dt = layer.in_proj(ctx.zero_padding(hidden))[:, 0].split([layer.d_inner, layer.conv_dim,
                                                                      layer.num_heads], dim=-1)
    conv, state = conv0.clone(), state0.clone()
    y = mamba2_decode_step_reference(
        z, xbc, dt, conv, state, layer.conv1d.weight, layer.conv1d.bias, layer.dt_bias, layer.A_log, layer.D,
        layer.norm_weight, layer.z_bias, head_dim=layer.head_dim, d_state=layer.d_state, n_groups=layer.n_groups,
        d_xb=layer.d_xb, norm_eps=layer.norm_eps, keep=None if ctx.key_mask is None else ctx.key_mask[:, -1])
    got = layer.out_proj(y.to(dtype).unsqueeze(1))
    assert torch.equal(got, want)
    assert torch.equal(conv, entry.conv_states["conv"]) and torch.equal(state, entry.state)
    assert not torch.equal(state, state0) and not torch.equal(conv, conv0)
    if padded:
        assert torch.equal(y[1], torch.zeros_like(y[1]))


# ------------------------------------------------------------------ the interpreter runs (subprocesses)

# (batch, heads, head_dim, d_state, n_groups, d_xb (None: d_inner), conv width, conv bias, z bias, padded row,
#  activations, parameters, conv-state buffer dtype)
F32, BF16 = torch.float32, torch.bfloat16
KERNEL_CASES = [
    (2, 4, 8, 16, 2, None, 4, True, True, False, F32, F32, F32),
    (3, 4, 8, 16, 2, None, 4, True, False, True, F32, F32, F32),     # a padded row
    (2, 6, 8, 16, 3, 16, 4, False, True, False, F32, F32, F32),      # x and B repeated 3x, one B group
    (2, 8, 8, 8, 4, 16, 4, True, True, True, F32, F32, F32),         # repeated 4x over norm groups of 2 heads
    (1, 4, 24, 12, 1, None, 3, True, True, False, F32, F32, F32),    # not powers of 2, one norm group
    (2, 2, 16, 128, 2, None, 4, True, False, False, F32, F32, F32),  # d_state 128: value channels in 2 tiles
    (2, 4, 8, 16, 2, None, 4, True, True, True, BF16, BF16, BF16),
    (2, 8, 8, 8, 4, 16, 4, True, True, False, BF16, BF16, F32),      # bf16 model, fp32 conv-state buffer
    (2, 8, 8, 8, 4, 16, 4, True, True, False, BF16, F32, F32),       # bf16 activations, fp32 parameters
]


def _kernel_case(case, seed):
    from hybridlm.ops.mamba2_step import mamba2_decode_step
    B, H, P, N, G, d_xb, W, conv_bias, z_bias, padded, adt, pdt, cdt = case
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dtype=pdt):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    d_inner = H * P
    d_xb = d_xb or d_inner
    d_b = G * N * d_xb // d_inner
    conv_dim = d_xb + d_b + G * N
    z, xbc, dt = rnd(B, d_inner + conv_dim + H, dtype=adt).split([d_inner, conv_dim, H], dim=-1)  # views
    conv, state = rnd(B, conv_dim, W, dtype=cdt), rnd(B, H, N, P, scale=0.5, dtype=F32)
    params = [rnd(conv_dim, W, scale=0.5), rnd(conv_dim, scale=0.3) if conv_bias else None, rnd(H),
              rnd(H, scale=0.5), rnd(H), 1 + rnd(d_inner, scale=0.3), rnd(d_inner, scale=0.3) if z_bias else None]
    keep = torch.tensor([i != B - 1 for i in range(B)]) if padded else None
    kw = dict(head_dim=P, d_state=N, n_groups=G, d_xb=d_xb, norm_eps=1e-6, keep=keep)
    conv_t, state_t = conv.clone(), state.clone()
    want = mamba2_decode_step_reference(z, xbc, dt, conv_t, state_t, *params, **kw)
    ptrs = conv.data_ptr(), state.data_ptr()
    got = mamba2_decode_step(z, xbc, dt, conv, state, *params, **kw)
    assert (conv.data_ptr(), state.data_ptr()) == ptrs

    def err(a, b):
        return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1.0)
    return {"case": repr(case), "bf16": adt == BF16, "dtype_ok": got.dtype == want.dtype, "y": err(got, want),
            "conv_equal": torch.equal(conv, conv_t), "state": err(state, state_t)}


def run_kernel_cases() -> list:
    interpreter_rounds_like_gpu()
    return [_kernel_case(case, seed) for seed, case in enumerate(KERNEL_CASES)]


# LAYER_CONFIGS entry -> the runs compared (the interpreter takes ~0.4 s a kernel call)
MODEL_CONFIGS = {"groups": ("dynamic", "static", "padded"), "xb_repeat": ("static", "padded")}
NEW = 4  # tokens generated: the prompt's and three decode steps


def run_model_cases() -> dict:
    """Greedy decoding of a tiny ``M-*-M-`` hybrid: unfused (the CPU path) against its Mamba2 layers' one-token
    steps forced onto the Triton path, i.e. the fused kernel (the interpreter runs it)."""
    from hybridlm.model import HybridForCausalLM
    from hybridlm.model.layers import mamba2 as M

    calls = []
    kernel = M.mamba2_decode_step

    def counted(*a, **k):
        calls.append(1)
        return kernel(*a, **k)

    @contextlib.contextmanager
    def fused(on):
        saved = M.use_triton, M.mamba2_decode_step
        if on:
            M.use_triton, M.mamba2_decode_step = (lambda backend, x: x.shape[1] == 1), counted
        try:
            yield
        finally:
            M.use_triton, M.mamba2_decode_step = saved

    def decode(model, ids, new, static, mask=None, forced=None):
        B, T = ids.shape
        cache, ptrs = None, None
        if static:
            cache = HybridCache(model.config, max_length=T + new - 1, batch_size=B, dtype=torch.float32, device="cpu")
            ptrs = {k: t.data_ptr() for k, t in cache.static_tensors().items()}

        def column(i, mask):  # row 1's second decode token is padding
            col = torch.ones_like(mask[:, :1])
            col[1] = int(i != 1)
            return col

        tokens, logits, cache, _ = greedy_decode(model, ids, new, cache, mask, forced, column)
        same_buffers = (not static) or ptrs == {k: t.data_ptr() for k, t in cache.static_tensors().items()}
        states = [t.clone() for layer in cache.layers for t in layer.tensors().values()]
        return tokens, logits, states, same_buffers

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    out = {}
    with torch.no_grad():
        for name in MODEL_CONFIGS:
            torch.manual_seed(0)
            model = HybridForCausalLM(tiny_config("M-*-M-", mixer="mamba2", mamba2=LAYER_CONFIGS[name])).eval()
            ids = torch.randint(1, 512, (2, 7), generator=torch.Generator().manual_seed(1))
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            forced = torch.randint(1, 512, (2, NEW - 1), generator=torch.Generator().manual_seed(2))
            scenarios = {"dynamic": dict(static=False), "static": dict(static=True),
                         "padded": dict(static=False, mask=mask, forced=forced)}
            for scenario in MODEL_CONFIGS[name]:
                with fused(False):
                    base = decode(model, ids, NEW, **scenarios[scenario])
                calls.clear()
                with fused(True):
                    got = decode(model, ids, NEW, **scenarios[scenario])
                out[f"{name}/{scenario}"] = {
                    "same_tokens": torch.equal(got[0], base[0]), "logits": rel(got[1], base[1]),
                    "states": max(rel(a, b) for a, b in zip(got[2], base[2])), "same_buffers": got[3],
                    "kernel_calls": len(calls)}
    return out


@pytest.fixture(scope="module")
def interpreter_runs():
    return run_under_interpreter({mode: [sys.executable, __file__, mode] for mode in ("kernel", "model")})


def test_kernel_equals_the_twin_in_the_interpreter(interpreter_runs):
    rows = interpreter_runs["kernel"]
    assert len(rows) == len(KERNEL_CASES)
    for r in rows:
        assert r["dtype_ok"] and r["conv_equal"], r
        assert r["y"] < (1e-5 if not r["bf16"] else 8e-3), r  # bf16: at most an ulp (measured: equal)
        assert r["state"] < 1e-5, r


def test_tiny_model_decodes_the_same_through_the_kernel(interpreter_runs):
    runs = interpreter_runs["model"]
    assert len(runs) == sum(len(v) for v in MODEL_CONFIGS.values())
    for key, r in runs.items():
        assert r["kernel_calls"] == 2 * (NEW - 1), (key, r)  # two Mamba2 layers, every decode step
        assert r["same_tokens"] and r["same_buffers"], (key, r)
        assert r["logits"] < 1e-5 and r["states"] < 1e-5, (key, r)


if __name__ == "__main__":  # python tests/test_mamba2_step.py kernel|model -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases() if sys.argv[1] == "kernel" else run_model_cases()))
