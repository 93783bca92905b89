"""The training-time fusions on the GPU path (their torch-path tests are tests/test_fused_training.py). On CUDA at the
shapes below; under Triton's interpreter at conftest's tiny shapes (tests/support/gpu_path.py).

1. The packed SwiGLU kernels (hybridlm/ops/swiglu_packed.py) compiled, at the 300M MLP's width with the packed
   tensor a GEMM's output: forward and gradient against the torch twin in fp64 on the CPU, and no worse than fla's
   ``swiglu`` of the two halves.
2. A training step of two blocks of each sublayer kind on fla's kernels (bf16), with ``fuse_projections``,
   ``fuse_residual_norm``, ``split_conv_outputs``, ``projection_grads_in_place`` and ``qk_norm_in_conv`` on
   against all off (same weights), each measured against the same weights in fp32 through the torch path: loss,
   and every gradient no further from fp32 than the unfused step's (fla's fused add + norm, its kernels reading column
   slices and the recurrences fed by the split conv outputs, q and k normalised and repeated there instead of in
   fla's kernels, are what the CPU cannot run); then a forward under ``no_grad``, where the fusions step aside.
"""
import pytest
import torch

from conftest import rel_err
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.ops.swiglu_packed import swiglu_packed_kernel, swiglu_packed_reference
from tests.support.gpu_path import DEVICE, generator, scaled

pytestmark = [pytest.mark.gpu]


def _value_and_grad(fn, y, dz):
    leaf = y.detach().clone().requires_grad_(True)
    z = fn(leaf)
    z.backward(dz)
    return z.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_packed_swiglu_matches_the_twin_and_fla(dtype):
    from fla.modules.activations import swiglu
    torch.manual_seed(0)
    # under the interpreter, rows and columns that end in part of a tile
    T, F = scaled((1000, 4096), (37, 100))
    y = torch.randn(2, T, 2 * F, device=DEVICE, dtype=dtype) * 2
    dz = torch.randn(2, T, F, device=DEVICE, dtype=dtype)
    ours = _value_and_grad(swiglu_packed_kernel, y, dz)
    twin = _value_and_grad(swiglu_packed_reference, y.double().cpu(), dz.double().cpu())
    fla = _value_and_grad(lambda t: swiglu(*t.chunk(2, -1)), y, dz)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, o, t, f in zip(("z", "dy"), ours, twin, fla):
        assert o.dtype == dtype and o.shape == t.shape, name
        assert rel_err(o, t) < tol, (name, rel_err(o, t))
        assert rel_err(o, t) <= 1.5 * rel_err(f, t) + 1e-7, (name, rel_err(o, t), rel_err(f, t))


SHAPES = scaled(
    dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
         mla=dict(num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32),
         gdn=dict(num_heads=2, head_dim=64, num_v_heads=4, head_v_dim=64),
         kda=dict(num_heads=2, head_dim=64, num_v_heads=2, head_v_dim=64),
         mamba2=dict(d_state=64, head_dim=64, n_groups=1, expand=2)),
    # conftest's tiny_config shapes, one Mamba2 group as above, a smaller vocabulary
    dict(vocab_size=256, hidden_size=64, intermediate_size=128,
         mla=dict(num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
         gdn=dict(num_heads=2, head_dim=16, num_v_heads=4, head_v_dim=8),
         kda=dict(num_heads=2, head_dim=16, num_v_heads=2, head_v_dim=16),
         mamba2=dict(d_state=16, head_dim=16, n_groups=1, expand=2)))
# under the interpreter one sequence within fla's 64-token chunk: test_triton_paths runs these fusions (the runtime's
# defaults) on two sequences past it
BATCH, SEQ = scaled((2, 512), (1, 40))


def _model(pattern, backend="triton", gdn_biases=False, **switches):
    """Backend ``triton`` runs on CUDA, and on a CPU under the interpreter. ``gdn_biases``: GDN with the gate and
    beta biases of the upcycled students, drawn at random."""
    torch.manual_seed(0)
    shapes = dict(SHAPES, gdn=dict(SHAPES["gdn"], gate_bias=True, beta_bias=True)) if gdn_biases else SHAPES
    cfg = HybridConfig(**shapes, runtime=dict(backend=backend, **switches), hybrid_override_pattern=pattern,
                       initializer_range=0.05)
    model = HybridForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("g_bias", "b_bias")):
                p.normal_(0.0, 1.0)
    return model.to(DEVICE).train()


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


UNFUSED = dict(fuse_projections=False, fuse_residual_norm=False, split_conv_outputs=False,
               projection_grads_in_place=False, qk_norm_in_conv=False)
ALL_ON = dict(split_conv_outputs=True, projection_grads_in_place=True, qk_norm_in_conv=True)
# GDN also runs without the q / k norm, and without the in-place gradients: each held to the same bound
CASES = [("G-G-", ALL_ON), ("G-G-", dict(ALL_ON, qk_norm_in_conv=False)),
         ("G-G-", dict(ALL_ON, projection_grads_in_place=False)),
         ("G-G-", dict(ALL_ON, gdn_biases=True)), ("K-K-", ALL_ON), ("S-S-", ALL_ON), ("*-*-", ALL_ON)]


# one sublayer kind per case (each compiles only its own kernels: a fresh machine spends minutes autotuning fla's),
# two blocks deep so that a residual add goes into a norm between them; bf16, as training runs
@pytest.mark.parametrize("pattern,keys", CASES, ids=["gdn", "gdn-no_qk_norm", "gdn-not_in_place", "gdn-biases",
                                                     "kda", "mamba2", "mla"])
def test_fused_training_step_matches_the_unfused_one(pattern, keys):
    biases = keys.get("gdn_biases", False)
    fused = _model(pattern, **keys).to(torch.bfloat16)
    plain = _model(pattern, gdn_biases=biases, **UNFUSED).to(torch.bfloat16)
    plain.load_state_dict(fused.state_dict())
    # the referee: the same weights in fp32 through the torch path (no TF32), which neither side shares
    reference = _model(pattern, backend="torch", gdn_biases=biases, **UNFUSED)
    reference.load_state_dict({n: t.float() for n, t in fused.state_dict().items()})
    ids = torch.randint(1, SHAPES["vocab_size"], (BATCH, SEQ), device=DEVICE, generator=generator(1))
    (loss_f, grads_f), (loss_p, grads_p) = (_loss_and_grads(m, ids) for m in (fused, plain))
    loss_r, grads_r = _loss_and_grads(reference, ids)
    assert abs(loss_f - loss_r) < 2e-3 * abs(loss_r) and abs(loss_p - loss_r) < 2e-3 * abs(loss_r)
    # Both sides round their bf16 intermediates differently (the fused GEMM sums the input gradients in fp32
    # before one rounding; fla's norm adds the residual in fp32; q and k normalised from the conv's fp32 output
    # instead of its bf16 rounding). Gradients that sum over every position (a head's decay) differ between two
    # such bf16 runs by more than either differs from fp32, so each is measured against the fp32 referee: the
    # fused step must be as accurate as the unfused one, parameter by parameter.
    errors = {n: (rel_err(grads_f[n], grads_r[n]), rel_err(grads_p[n], grads_r[n]))
              for n in grads_r if grads_r[n].norm() > 0}
    print("\nworst against fp32 (fused, unfused):",
          sorted(errors.items(), key=lambda kv: -kv[1][0])[:4])
    for n, (err_f, err_p) in errors.items():
        assert err_f < 0.1 and err_f <= 2 * err_p + 5e-3, (n, err_f, err_p)
    with torch.no_grad():  # evaluation: the projections and convs run apart, q and k normalised in fla's kernels
        logits_f, logits_p = (m(input_ids=ids).logits.float() for m in (fused, plain))
    assert rel_err(logits_f, logits_p) < 2e-2
