"""The fused Mamba2 decode step on CUDA (hybridlm/ops/mamba2_step.py): the Triton kernel against its torch twin
in fp32 and bf16 at the tests' and the configs' shapes, the kernels a layer's step launches with and without it,
and CUDA-graph captured decoding of a tiny hybrid giving the same tokens with and without it. Without CUDA the kernel
runs through Triton's interpreter (the 300M case at batch 2: tests/support/gpu_path.py); the kernel count and the
graphs need CUDA."""
import pytest
import torch

from conftest import greedy_decode
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.cache import HybridCache, InferenceContext
from hybridlm.model.layers.mamba2 import Mamba2
from hybridlm.ops.mamba2_step import mamba2_decode_step, mamba2_decode_step_reference
from tests.support.gpu_path import DEVICE, generator, scaled

pytestmark = pytest.mark.gpu

# fp32: the same math, GPU exp / log / rsqrt approximations apart; bf16: every rounding point is the composed
# path's, so only a rare flip at a tie differs (the bound is the other GPU tests' bf16 tolerance)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

# (batch, heads, head_dim, d_state, n_groups, d_xb (None: d_inner), conv width, conv bias, z bias, padded row)
CASES = {
    "tiny": (2, 8, 16, 16, 2, None, 4, True, False, False),                  # tests/conftest.py tiny_config
    "300m": (scaled(4, 2), 32, 64, 64, 8, None, 4, True, False, False),      # configs/models/mamba2_300m*.yaml
    "300m_b1": (1, 32, 64, 64, 8, None, 4, True, False, False),
    "route": (3, 9, 64, 64, 9, 192, 4, True, True, False),                   # SmolLM2 upcycled: x / B repeated 3x
    "one_group": (2, 16, 64, 128, 1, None, 4, False, True, False),           # Mamba2's n_groups 1, d_state 128
    "odd_padded": (3, 6, 24, 12, 3, 48, 3, True, True, True),                # no powers of 2, a padded row
}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _inputs(case, dtype, seed=0):
    B, H, P, N, G, d_xb, W, conv_bias, z_bias, padded = case
    g = generator(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dt)
    d_inner = H * P
    d_xb = d_xb or d_inner
    d_b = G * N * d_xb // d_inner
    conv_dim = d_xb + d_b + G * N
    z, xbc, dt = rnd(B, d_inner + conv_dim + H).split([d_inner, conv_dim, H], dim=-1)
    states = rnd(B, conv_dim, W), rnd(B, H, N, P, scale=0.5, dt=torch.float32)
    params = [rnd(conv_dim, W, scale=0.5), rnd(conv_dim, scale=0.3) if conv_bias else None, rnd(H),
              rnd(H, scale=0.5), rnd(H), 1 + rnd(d_inner, scale=0.3), rnd(d_inner, scale=0.3) if z_bias else None]
    keep = torch.tensor([i != B - 1 for i in range(B)], device=DEVICE) if padded else None
    kw = dict(head_dim=P, d_state=N, n_groups=G, d_xb=d_xb, norm_eps=1e-6, keep=keep)
    return (z, xbc, dt), states, params, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_kernel_matches_the_twin(name, dtype):
    proj, (conv, state), params, kw = _inputs(CASES[name], dtype)
    conv_t, state_t = conv.clone(), state.clone()
    for step in range(4):  # consecutive tokens: the in-place states carry over
        want = mamba2_decode_step_reference(*proj, conv_t, state_t, *params, **kw)
        got = mamba2_decode_step(*proj, conv, state, *params, **kw)
        assert got.dtype == want.dtype
        assert torch.equal(conv, conv_t)  # the conv state is the inputs shifted: exact
        assert _rel(got, want) < TOL[dtype], (step, _rel(got, want))
        assert _rel(state, state_t) < TOL[dtype], (step, _rel(state, state_t))
        proj = tuple(t.roll(1, 0) for t in proj)


def _tiny_hybrid(dtype, **mamba2):
    torch.manual_seed(0)
    cfg = HybridConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, hybrid_override_pattern="*-M-M-", mixer="mamba2",
        mla=dict(num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                 v_head_dim=32),
        mamba2=dict(dict(d_state=32, head_dim=32, n_groups=4, expand=2), **mamba2))
    return HybridForCausalLM(cfg).cuda().to(dtype).eval()


def _kernels(fn) -> list:
    """Names of the CUDA kernels ``fn()`` launches."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "Memcpy" not in e.name and "Memset" not in e.name]


@torch.no_grad()
def test_a_layer_step_is_two_gemms_and_the_fused_kernel():
    """One cached token through a Mamba2 layer (static cache): in_proj, the fused kernel, out_proj; unfused the
    same step launches a couple of dozen kernels."""
    model = _tiny_hybrid(torch.bfloat16, d_xb=128, gate_bias=True)
    layer = model.model.layers[2].mixer
    assert isinstance(layer, Mamba2)
    cache = HybridCache(model.config, max_length=8, batch_size=2, dtype=torch.bfloat16, device="cuda")
    ctx = InferenceContext.build(cache, None, None, 1, torch.device("cuda"))  # reused: Mamba2 reads its states only
    hidden = torch.randn(2, 1, 256, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(hidden, ctx)
    step()  # compile
    fused = _kernels(step)
    model.set_runtime(mamba2_fused_step=False)
    step()
    unfused = _kernels(step)
    print(f"\nkernels per Mamba2 decode step: fused {len(fused)} {fused}\nunfused {len(unfused)} {unfused}")
    assert sum("mamba2_step" in k for k in fused) == 1
    assert len(fused) <= 5  # two GEMMs (cuBLAS may split one) and the fused kernel
    assert len(unfused) >= 3 * len(fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mamba2", [{}, dict(d_xb=128, gate_bias=True)], ids=["groups", "xb_repeat"])
@torch.no_grad()
def test_graphed_decode_with_and_without_the_fused_step(mamba2, dtype):
    """GraphedDecoder (a captured step replayed per token) on a static cache: the fused step gives the unfused
    step's greedy tokens (fp32; bf16 teacher-forced on them, logits within the bf16 tolerance), and the cache
    buffers keep their addresses."""
    model = _tiny_hybrid(dtype, **mamba2)
    B, P, new = 3, 37, 16
    ids = torch.randint(1, 4096, (B, P), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def run(fused, forced=None):
        model.set_runtime(mamba2_fused_step=fused)
        cache = HybridCache(model.config, max_length=P + new - 1, batch_size=B, dtype=dtype, device="cuda")
        ptrs = {k: t.data_ptr() for k, t in cache.static_tensors().items()}
        tokens, logits, _, decoder = greedy_decode(model, ids, new, cache, forced=forced)
        assert decoder.graph is not None
        assert ptrs == {k: t.data_ptr() for k, t in cache.static_tensors().items()}
        return tokens, logits

    base_tokens, base_logits = run(False)
    tokens, logits = run(True, forced=None if dtype == torch.float32 else base_tokens)
    err = _rel(logits, base_logits)
    print(f"\n{mamba2} {dtype}: logits rel err fused vs unfused {err:.2e}")
    if dtype == torch.float32:
        assert torch.equal(tokens, base_tokens)
        assert err < 1e-4
    else:
        assert err < TOL[dtype]
