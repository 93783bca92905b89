"""MLA's split-K decode attention on CUDA (hybridlm/ops/latent_decode.py): the kernels against their torch twin in
fp32 and bf16 at the tests' and the configs' shapes, and CUDA-graph captured decoding of a tiny hybrid giving the
same tokens through the kernel as through SDPA. Without CUDA the kernels run through Triton's interpreter at the same
shapes (tests/support/gpu_path.py); the graphs need CUDA."""
import pytest
import torch

from conftest import greedy_decode
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.cache import HybridCache
from hybridlm.ops.latent_decode import latent_attention_decode, latent_attention_decode_reference
from tests.support.gpu_path import DEVICE, generator

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

# (batch, heads, T, latent, rope, keys): the tests' tiny MLA, the 300M hybrids', the SmolLM2 route's at 8k
CASES = {"tiny": (2, 4, 1, 32, 16, 300), "300m": (8, 16, 1, 64, 32, 2100), "route_8k_b1": (1, 9, 1, 128, 16, 8320),
         "route_1k_b48": (48, 9, 1, 128, 16, 1152), "two_tokens": (3, 16, 2, 64, 32, 999)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_twin(name, dtype):
    B, H, T, R, RO, S = CASES[name]
    g = generator(0)
    q = torch.randn(B, H * T, R + RO, device=DEVICE, generator=g).to(dtype)
    kv = torch.randn(B, S, R + RO, device=DEVICE, generator=g).to(dtype)
    keys = torch.arange(S, device=DEVICE)
    last = torch.randint(S // 2, S, (B,), device=DEVICE, generator=g)  # slots written so far, per row
    mask = keys[None, None, :] <= (last[:, None, None] - (T - 1) + torch.arange(T, device=DEVICE)[None, :, None])
    mask[0, :, : S // 10] = False                                        # a left-padded row
    got = latent_attention_decode(q, kv, mask, (R + RO) ** -0.5, R, T)
    want = latent_attention_decode_reference(q, kv, mask, (R + RO) ** -0.5, R, T)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    print(f"\n{name} {dtype}: rel err {err:.2e}")
    assert got.dtype == dtype and err < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@torch.no_grad()
def test_graphed_decode_through_the_kernel_and_through_sdpa(dtype):
    torch.manual_seed(0)
    cfg = HybridConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, hybrid_override_pattern="*-M-*-M-", mixer="mamba2",
        mla=dict(num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                 v_head_dim=32),
        mamba2=dict(d_state=32, head_dim=32, n_groups=4, expand=2))
    model = HybridForCausalLM(cfg).cuda().to(dtype).eval()
    B, P, new = 3, 300, 16
    ids = torch.randint(1, 4096, (B, P), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def run(split_k, forced=None):
        model.set_runtime(mla_split_k_decode=split_k)
        cache = HybridCache(model.config, max_length=P + new - 1, batch_size=B, dtype=dtype, device="cuda")
        tokens, logits, _, decoder = greedy_decode(model, ids, new, cache, forced=forced)
        assert decoder.graph is not None
        return tokens, logits

    base_tokens, base_logits = run(False)
    tokens, logits = run(True, forced=None if dtype == torch.float32 else base_tokens)
    err = ((logits.double() - base_logits.double()).norm() / base_logits.double().norm()).item()
    print(f"\n{dtype}: logits rel err split-K vs SDPA {err:.2e}")
    if dtype == torch.float32:
        assert torch.equal(tokens, base_tokens) and err < 1e-4
    else:
        assert err < 3e-2
