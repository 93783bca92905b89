"""The RMSNorm kernels (hybridlm/ops/rms_norm.py), Mamba2's fused output stage (hybridlm/ops/gated_norm.py), the
cross-entropy kernel (hybridlm/ops/cross_entropy.py) and KD's chunk kernel (hybridlm/ops/kd_divergence.py) compiled
on a GPU, at the 300M models' (KD: SmolLM2's) training widths: against their torch twins in fp64 on the CPU, and no
worse than the fla kernels they replace (without CUDA, through Triton's interpreter at smaller shapes:
tests/support/gpu_path.py; the CPU twins of these tests are tests/test_rms_norm.py, tests/test_gated_norm.py,
tests/test_cross_entropy.py and tests/test_kd_divergence.py)."""
import pytest
import torch

from conftest import rel_err
from hybridlm.ops.cross_entropy import cross_entropy_kernel, cross_entropy_reference
from hybridlm.ops.gated_norm import gated_norm_skip_reference, norm_then_gate_reference
from hybridlm.ops.rms_norm import rms_norm_kernel, rms_norm_reference
from tests.support.gpu_path import DEVICE, scaled

pytestmark = pytest.mark.gpu
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def _norm_grads(fn, x, delta, weight, dy, ds):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (x, delta, weight)]
    y, s = fn(*leaves)
    loss = (y.double() * dy.double()).sum() + (0 if s is None else (s.double() * ds.double()).sum())
    loss.backward()
    return [y.detach()] + ([] if s is None else [s.detach()]) + [t.grad for t in leaves if t is not None]


@DTYPES
@pytest.mark.parametrize("with_delta", [True, False], ids=["residual", "plain"])
def test_rms_norm_matches_the_twin_and_fla(dtype, with_delta):
    from fla.modules.layernorm import rms_norm as fla_rms_norm
    torch.manual_seed(0)
    R, D, eps = scaled(4 * 2048, 4 * 8) + 3, scaled(1024, 128), 1e-6  # rows not a multiple of any row block
    x = torch.randn(R, D, device=DEVICE, dtype=dtype)
    delta = torch.randn(R, D, device=DEVICE, dtype=dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(D, device=DEVICE)).to(dtype)
    dy, ds = torch.randn(R, D, device=DEVICE, dtype=dtype), torch.randn(R, D, device=DEVICE, dtype=dtype)

    def ours(x, d, w):
        out = rms_norm_kernel(x, w, eps, d)
        return out if d is not None else (out, None)

    def fla(x, d, w):
        if d is None:
            return fla_rms_norm(x, w, None, eps=eps), None
        return fla_rms_norm(d, w, None, residual=x, eps=eps, prenorm=True)

    def twin(x, d, w):
        y, s = rms_norm_reference(x, w, eps, d)
        return y, (s if d is not None else None)

    cpu64 = lambda t: None if t is None else t.detach().cpu().double()  # noqa: E731
    got = _norm_grads(ours, x, delta, weight, dy, ds)
    want = _norm_grads(twin, cpu64(x), cpu64(delta), cpu64(weight), cpu64(dy), cpu64(ds))
    peer = _norm_grads(fla, x, delta, weight, dy, ds)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert len(got) == len(want) == len(peer) == (5 if with_delta else 3)
    for i, (o, t, f) in enumerate(zip(got, want, peer)):
        assert o.dtype == dtype and o.shape == t.shape, i
        assert rel_err(o, t) < tol, (i, rel_err(o, t))
        assert rel_err(o, t) <= 1.5 * rel_err(f, t) + 1e-6, (i, rel_err(o, t), rel_err(f, t))


def _check_output_stage(op, reference, inputs, dout, names, dtype):
    """A gated output norm ``op(norm_kernel, *inputs)`` through the project's kernel: outputs and gradients within
    ``tol`` of ``reference`` in fp64 on the CPU and no worse than through fla's kernel (``runtime.norm_kernel``
    fla)."""

    def grads(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        out = fn(*leaves)
        (out.double() * dout.to(out.device).double()).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    def through(source):
        return lambda *tensors: op(source, *tensors)

    got = grads(through("project"), *inputs)
    peer = grads(through("fla"), *inputs)
    want = grads(reference, *(t.detach().cpu().double() for t in inputs))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, o, t, f in zip(names, got, want, peer):
        assert o.dtype == dtype and o.shape == t.shape, name
        assert rel_err(o, t) < tol, (name, rel_err(o, t))
        assert rel_err(o, t) <= 1.5 * rel_err(f, t) + 1e-6, (name, rel_err(o, t), rel_err(f, t))


@DTYPES
def test_gdn_output_norm_matches_the_twin_and_fla(dtype):
    """At GDN-300M's widths (8 value heads of 64), z a strided column slice of the fused projection, viewed per
    head, as the layer passes it; the peer is fla's gated norm, which copies z first."""
    from hybridlm.ops.elementwise import gated_rms_norm
    torch.manual_seed(0)
    R, H, V, eps = scaled(4 * 1024, 4 * 8) + 3, 8, 64, 1e-6
    y = torch.randn(R, H, V, device=DEVICE, dtype=dtype)
    z = torch.randn(R, 3 * H * V + 16, device=DEVICE, dtype=dtype)[:, 16 + 2 * H * V:].unflatten(-1, (H, V))
    weight = (1 + 0.1 * torch.randn(V, device=DEVICE)).to(dtype)
    dout = torch.randn(R, H, V, device=DEVICE, dtype=dtype)
    _check_output_stage(
        lambda kernel, y, z, w: gated_rms_norm(y, z, w, eps, triton=True, norm_kernel=kernel),
        lambda y, z, w: norm_then_gate_reference(y.flatten(-2), z.flatten(-2), w, eps).view(y.shape),
        (y, z, weight), dout, ("out", "dy", "dz", "dw"), dtype)


@DTYPES
def test_mamba2_output_stage_matches_the_twin_and_fla(dtype):
    """At Mamba2-300M's widths (2,048 channels, 32 heads, 8 groups; interpreted: 512 channels, 8 heads, 2 groups,
    4 heads a group either way), x and z strided slices of one projection; the peer is the unfused path on fla's
    grouped gated norm."""
    from hybridlm.ops.elementwise import skip_gated_rms_norm
    torch.manual_seed(0)
    R, C, H, G, eps = scaled(4 * 1024, 4 * 8) + 3, scaled(2048, 512), scaled(32, 8), 256, 1e-5
    y = torch.randn(R, C, device=DEVICE, dtype=dtype)
    proj = torch.randn(R, 2 * C + 64, device=DEVICE, dtype=dtype)
    x, z = proj[:, 64:64 + C], proj[:, 64 + C:]
    D = (1 + 0.3 * torch.randn(H, device=DEVICE)).to(dtype)
    weight = (1 + 0.1 * torch.randn(C, device=DEVICE)).to(dtype)
    dout = torch.randn(R, C, device=DEVICE, dtype=dtype)
    _check_output_stage(
        lambda kernel, y, x, D, z, w: skip_gated_rms_norm(y, x, D, z, w, eps, G, triton=True, norm_kernel=kernel),
        lambda *a: gated_norm_skip_reference(*a, eps, G),
        (y, x, D, z, weight), dout, ("out", "dy", "dx", "dD", "dz", "dw"), dtype)


@DTYPES
def test_cross_entropy_matches_the_twin_and_fla(dtype):
    from fla.modules.fused_cross_entropy import cross_entropy_loss
    torch.manual_seed(0)
    R, V = scaled(300, 37), scaled(128256, 200)  # Llama-3's vocabulary (interpreted: blocks of 16): the last
    # block of the sweeps is partial
    logits = (torch.randn(R, V, device=DEVICE) * 4).to(dtype)
    target = torch.randint(0, V, (R,), device=DEVICE)
    target[::7] = -100
    inv_n = (target != -100).sum().float().reciprocal()
    buf = logits.clone()
    losses = cross_entropy_kernel(buf, target, inv_n, write_grad=True)
    want_losses, want_grad = cross_entropy_reference(logits.cpu().double(), target.cpu(), inv_n.cpu().double())
    leaf = logits.clone().requires_grad_(True)
    fla_losses = cross_entropy_loss(leaf, target, ignore_index=-100)[0]
    (fla_grad,) = torch.autograd.grad(fla_losses, leaf, grad_outputs=inv_n.expand_as(fla_losses))
    assert buf.dtype == dtype and losses.dtype == torch.float32
    assert rel_err(losses, want_losses) < 1e-6
    assert rel_err(buf, want_grad) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(losses, want_losses) <= 1.5 * rel_err(fla_losses, want_losses) + 1e-7
    assert rel_err(buf, want_grad) <= 1.5 * rel_err(fla_grad, want_grad) + 1e-6


def test_chunked_loss_with_either_kernel_agrees():
    """The model's chunked LM-head loss (hybridlm/model/loss.py) with the project's kernel against fla's: the loss
    and the gradients of the hidden states and the head, bf16 as in training."""
    from hybridlm.model.loss import linear_cross_entropy
    torch.manual_seed(0)
    n, d, V = scaled(4096, 64), scaled(1024, 64), scaled(128256, 200)
    h = torch.randn(n, d, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(V, d, device=DEVICE) * 0.02).to(torch.bfloat16)
    y = torch.randint(0, V, (n,), device=DEVICE)
    y[::11] = -100
    results = {}
    for source in ("fla", "project"):
        hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = linear_cross_entropy(hl, wl, y, num_chunks=4, triton=True, loss_kernel=source)
        loss.backward()
        results[source] = (loss.detach(), hl.grad, wl.grad)
    for a, b in zip(results["project"], results["fla"]):
        assert rel_err(a, b) < 1e-2, rel_err(a, b)


def test_chunked_loss_gradients_match_full_fp32_logits():
    """The chunked head in bf16 (the weight gradient accumulated over chunks in fp32 by one GEMM each,
    hybridlm/model/loss.py ``add_product_fp32``) against torch's cross-entropy of the whole fp32 logits."""
    from hybridlm.model.loss import linear_cross_entropy
    torch.manual_seed(1)
    n, d, V = scaled(3000, 75), scaled(512, 64), scaled(32000, 200)
    h = torch.randn(n, d, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(V, d, device=DEVICE) * 0.02).to(torch.bfloat16)
    y = torch.randint(0, V, (n,), device=DEVICE)
    y[::7] = -100
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = linear_cross_entropy(hl, wl, y, num_chunks=5, triton=True)
    loss.backward()
    hr, wr = h.float().requires_grad_(True), w.float().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(hr @ wr.t(), y, ignore_index=-100)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-2 * ref.item()
    assert hl.grad.dtype == wl.grad.dtype == torch.bfloat16
    assert rel_err(hl.grad, hr.grad) < 1e-2, rel_err(hl.grad, hr.grad)
    assert rel_err(wl.grad, wr.grad) < 1e-2, rel_err(wl.grad, wr.grad)


@DTYPES
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.0, 0.5)], ids=["kl", "tempered_kl_ce"])
def test_kd_divergence_matches_the_twin(dtype, temperature, ce_weight):
    """KD's chunk kernel (hybridlm/ops/kd_divergence.py) at SmolLM2's vocabulary against its twin in fp64."""
    from hybridlm.ops.kd_divergence import kd_divergence_kernel, kd_divergence_reference
    torch.manual_seed(0)
    R, V = scaled(300, 37), scaled(49152, 200)  # interpreted: the last block of 16 partial
    student = (torch.randn(R, V, device=DEVICE) * 4).to(dtype)
    teacher = (torch.randn(R, V, device=DEVICE) * 4).to(dtype)
    target = torch.randint(0, V, (R,), device=DEVICE)
    buf = student.clone()
    kl, ce = kd_divergence_kernel(buf, teacher, target, temperature, 0.8, ce_weight, 1.0 / R, write_grad=True)
    want_kl, want_ce, want_grad = kd_divergence_reference(student.cpu().double(), teacher.cpu().double(),
                                                          target.cpu(), temperature, 0.8, ce_weight, 1.0 / R)
    assert rel_err(kl, want_kl) < 1e-5 and rel_err(ce, want_ce) < 1e-6
    assert rel_err(buf, want_grad) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_chunked_kd_on_the_kernel_equals_the_torch_ops():
    """KD's chunked loss (distill/kd_loss.py ``KDChunk`` through hybridlm/model/loss.py ``ChunkedLinearHead``) at
    the route's shapes in bf16, the chunk on the kernel against its torch ops: loss, KL and CE sums, the gradients
    of the student's hidden states and head."""
    from distill.kd_loss import KDChunk
    from hybridlm.model.loss import ChunkedLinearHead
    torch.manual_seed(0)
    n, d, V = scaled(4096, 64), scaled(576, 64), scaled(49152, 200)  # on CUDA SmolLM2-135M's width and vocabulary
    hs = torch.randn(n, d, device=DEVICE, dtype=torch.bfloat16)
    ws = (torch.randn(V, d, device=DEVICE) * 0.05).to(torch.bfloat16)
    ht = hs + 0.3 * torch.randn_like(hs)
    wt = ws + (0.01 * torch.randn(V, d, device=DEVICE)).to(torch.bfloat16)
    target = torch.randint(0, V, (n,), device=DEVICE)
    results = {}
    for triton in (False, True):
        h, w = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
        chunk = KDChunk(ht, wt, target, 1.5, 0.8, 0.2, triton=triton)
        loss = ChunkedLinearHead.apply(h, w, chunk, scaled(1024, 16), True)
        loss.backward()
        results[triton] = (loss.detach(), chunk.kl_sum, chunk.ce_sum, h.grad, w.grad)
    for a, b in zip(results[True], results[False]):
        assert rel_err(a, b) < 1e-2, rel_err(a, b)
