"""The stateless causal conv kernels (hybridlm/ops/causal_conv.py) compiled on a GPU: forward and the three
gradients against the torch twin (in fp64 on the CPU) and against fla's causal_conv1d, at a Mamba2-300M layer's width
with x a strided slice of the projection, as the model passes it. And ``causal_conv_split`` at GDN-300M's q | k | v
widths against a conv per block (the twin in fp64, and the project's single conv); with q and k L2-normalised per
head and repeated for GDN's value heads in the kernels, against the twin and against the path they replace (the
split conv, then fla's ``l2norm`` and ``repeat_interleave``). And the backward's pass 1 at fixed configurations with
the pre-activation from the products' x tile (``X_ONCE``) against the per-tap path. Without CUDA, through Triton's
interpreter at narrower widths and shorter sequences (tests/support/gpu_path.py); the CPU twin of this test is
tests/test_causal_conv.py."""
import pytest
import torch

from conftest import rel_err
from hybridlm.ops.causal_conv import (HeadNorm, causal_conv, causal_conv_reference, causal_conv_split,
                                      causal_conv_split_reference)
from tests.support.gpu_path import DEVICE, scaled

pytestmark = pytest.mark.gpu


def _assert_near_twin_and_no_worse(ours, twin, peer, dtype, names=None):
    """Each of ``ours`` (outputs, then gradients) within fp32 / bf16 tolerance of the fp64 ``twin``, and no
    further from it than ``peer``, the path it replaces, computed in the same dtype."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, (o, t, p) in enumerate(zip(ours, twin, peer)):
        name = names[i] if names else i
        assert o.dtype == dtype and o.shape == t.shape, name
        assert rel_err(o, t) < tol, (name, rel_err(o, t))
        assert rel_err(o, t) <= 1.5 * rel_err(p, t) + 1e-6, (name, rel_err(o, t), rel_err(p, t))


def _leaf(t):
    """A leaf with ``t``'s values and strides (``clone()`` makes a column slice contiguous): a strided x reaches the
    kernels strided, as the model passes it."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t).requires_grad_(True)


def _grads(fn, x, weight, bias, dy):
    leaves = [_leaf(t) if t is not None else None for t in (x, weight, bias)]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("T", [300, scaled(2048, 256)])
@pytest.mark.parametrize("tiles", [1, 4, 32], ids=["tiles1", "tiles4", "tiles32"])
def test_kernels_match_the_twin_and_fla(dtype, bias, T, tiles, monkeypatch):
    """``tiles``: time tiles per program of the backward's pass 1 (300 rows: 5 tiles, a partial group of 4; the
    longer T a whole number of groups)."""
    import hybridlm.ops.causal_conv as conv
    from fla.modules.convolution import causal_conv1d
    monkeypatch.setattr(conv, "TILES_PER_PROGRAM", tiles)
    torch.manual_seed(0)
    D, W, lead = scaled(3072, 24), 4, scaled(1024, 8)  # interpreted: channel blocks of 16, the last partial
    proj = torch.randn(2, T, lead + D + 32, device=DEVICE, dtype=dtype)
    x = proj[..., lead:lead + D]                                   # strided, as Mamba2's [x | B | C]
    weight = (torch.rand(D, W, device=DEVICE) - 0.5).to(dtype)
    b = (torch.randn(D, device=DEVICE) * 0.1).to(dtype) if bias else None
    dy = torch.randn(2, T, D, device=DEVICE, dtype=dtype)
    ours = _grads(lambda x, w, b: causal_conv(x, w, b), x, weight, b, dy)
    cpu64 = lambda t: None if t is None else t.detach().cpu().double()  # noqa: E731 (no TF32 convs on the CPU)
    twin = _grads(causal_conv_reference, cpu64(x), cpu64(weight), cpu64(b), cpu64(dy))
    fla = _grads(lambda x, w, b: causal_conv1d(x=x, weight=w, bias=b, activation="silu")[0], x, weight, b, dy)
    _assert_near_twin_and_no_worse(ours, twin, fla, dtype, ("y", "dx", "dw", "db"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_split_conv_matches_a_conv_per_block(dtype):
    torch.manual_seed(0)
    widths, T = scaled((256, 256, 512), (16, 16, 32)), scaled(2048, 70)  # interpreted: blocks of 16, 2 tiles
    D = sum(widths)
    proj = torch.randn(2, T, D + 528, device=DEVICE, dtype=dtype)
    x = proj[..., :D]                                              # q | k | v in front of b, a, z, as GDN's
    weights = [(torch.rand(w, 4, device=DEVICE) - 0.5).to(dtype) for w in widths]
    dys = [torch.randn(2, T, w, device=DEVICE, dtype=dtype) for w in widths]
    starts = [0, widths[0], widths[0] + widths[1]]

    def run(fn, x, weights, dys):
        leaves = [_leaf(t) for t in (x, *weights)]
        ys = fn(leaves[0], leaves[1:])
        torch.autograd.backward(ys, dys)
        return [y.detach() for y in ys] + [t.grad for t in leaves], ys

    per_block = lambda conv: lambda x, ws: [conv(x[..., s:s + w.shape[0]], w, None) for s, w in zip(starts, ws)]  # noqa: E731
    ours, ys = run(lambda x, ws: causal_conv_split(x, torch.cat(ws), None, widths), x, weights, dys)
    assert all(y.is_contiguous() and y.shape[-1] == w for y, w in zip(ys, widths))
    cpu64 = lambda t: t.detach().cpu().double()  # noqa: E731
    twin, _ = run(per_block(causal_conv_reference), cpu64(x), [cpu64(w) for w in weights], [cpu64(d) for d in dys])
    single, _ = run(per_block(causal_conv), x, weights, dys)
    _assert_near_twin_and_no_worse(ours, twin, single, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim,repeat", [(64, 2), (32, 1)], ids=["gdn", "kda"])
def test_split_conv_with_head_norm_matches_the_twin_and_fla_l2norm(dtype, head_dim, repeat):
    """GDN-300M's q | k | v (heads of 64, each q / k head shared by 2 value heads) and KDA-300M's (heads of 32):
    the normalised, repeated q and k and every gradient, no worse than fla's l2norm after the plain split conv."""
    from fla.modules.l2norm import l2norm
    torch.manual_seed(0)
    widths = scaled((256, 256, 512), (2 * head_dim, 2 * head_dim, 4 * head_dim))  # interpreted: 2 q / k heads
    T = scaled(2048, 70)  # two tiles, the second partial
    norm = HeadNorm(2, head_dim, repeat)
    D = sum(widths)
    x = torch.randn(2, T, D + 528, device=DEVICE, dtype=dtype)[..., :D]
    weight = (torch.rand(D, 4, device=DEVICE) - 0.5).to(dtype)
    dys = [torch.randn(2, T, w, device=DEVICE, dtype=dtype) for w in norm.output_widths(widths)]

    def run(fn, x, weight, dys):
        leaves = [_leaf(t) for t in (x, weight)]
        ys = fn(*leaves)
        torch.autograd.backward(ys, dys)
        return [y.detach() for y in ys] + [t.grad for t in leaves], ys

    def fla_norm(x, w):  # what the model ran before: the split conv, fla's l2norm in its kernels, then the repeat
        q, k, v = causal_conv_split(x, w, None, widths)
        return [l2norm(t.view(2, T, -1, head_dim)).repeat_interleave(repeat, dim=2).view(2, T, -1)
                for t in (q, k)] + [v]

    ours, ys = run(lambda x, w: causal_conv_split(x, w, None, widths, head_norm=norm), x, weight, dys)
    assert all(y.is_contiguous() and y.shape[-1] == w for y, w in zip(ys, norm.output_widths(widths)))
    cpu64 = lambda t: t.detach().cpu().double()  # noqa: E731
    twin, _ = run(lambda x, w: causal_conv_split_reference(x, w, None, widths, head_norm=norm), cpu64(x),
                  cpu64(weight), [cpu64(d) for d in dys])
    fla, _ = run(fla_norm, x, weight, dys)
    _assert_near_twin_and_no_worse(ours, twin, fla, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("block,rows,warps", [(32, 16, 4), (64, 16, 8), (32, 64, 8)])
def test_pass1_x_once_matches_the_per_tap_pre_activation(dtype, block, rows, warps):
    """The backward's pass 1 launched directly (not through its autotuner) at one configuration, with the
    pre-activation from the products' x tile (``X_ONCE``) and from a load per tap: the same da and weight and
    bias partials, up to the order of an fp32 sum over four taps. Mamba2-300M's width (interpreted: 80 channels, the
    last block partial), x strided, 300 rows."""
    import hybridlm.ops.causal_conv as conv
    torch.manual_seed(0)
    B, T, D, W, lead = 2, 300, scaled(3072, 80), 4, scaled(1024, 8)
    x = torch.randn(B, T, lead + D, device=DEVICE, dtype=dtype)[..., lead:]
    weight = (torch.rand(D, W, device=DEVICE) - 0.5).to(dtype)
    bias = (torch.randn(D, device=DEVICE) * 0.1).to(dtype)
    dy = torch.randn(B, T, D, device=DEVICE, dtype=dtype)
    pass1 = conv._kernels()[1]
    pass1 = pass1.fn if hasattr(pass1, "configs") else pass1  # the jitted kernel under its autotuner
    tiles = 2
    NG = -(-(-(-T // conv.BT)) // tiles)
    out = {}
    for once in (False, True):
        da = torch.empty(B, T, D, dtype=dtype, device=DEVICE)
        dw = torch.empty(B * NG, D, W, dtype=torch.float32, device=DEVICE)
        db = torch.empty(B * NG, D, dtype=torch.float32, device=DEVICE)
        seg = conv._segment_args([dy])
        pass1[(-(-D // block), NG, B)](x, weight, bias, *seg[:3], da, dw, db, T, NG, x.stride(0), x.stride(1),
                                      *seg[3:], 0.0, **conv._segment_constants(D, (D,)), W=W, WP=4, BT=conv.BT,
                                      TILES=tiles, HAS_BIAS=True, SILU=True, BD=block, BR=rows, X_ONCE=once,
                                      num_warps=warps)
        out[once] = (da, dw.sum(0), db.sum(0))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("da", "dw", "db"), out[False], out[True]):
        assert rel_err(b, a) < tol, (name, rel_err(b, a))
