"""The fused gated output norms (hybridlm/ops/gated_norm.py), CPU: Mamba2's (D skip, SiLU gate, grouped RMSNorm)
and GDN's (per-head RMSNorm, then the SiLU gate, the heads sharing the weight).

1. Its torch twin against the model's torch path (``skip_gated_rms_norm`` of hybridlm/ops/elementwise.py: the
   skip, then the grouped gated norm, what Mamba2 runs on CPU) and against an explicit loop over groups:
   outputs, and gradients of y, x, D, z and the weight.
2. The Triton forward and backward kernels through the interpreter (``TRITON_INTERPRET=1``, a subprocess)
   against the twin: fp32 to ~1e-5, bf16 within a rounding. Cases cover x and z as strided slices of one wider
   projection (as the model passes them), several groups of several heads, one group, rows that do not fill the
   last row block and more row blocks than backward programs.
   GDN's the same way: its twin against the model's torch path (``gated_rms_norm``, norm before gate) and a loop
   over heads, its kernels in the interpreter with z a strided slice of a wider projection, as GDN passes it.
3. Both kernels writing z's gradient into its slot of a split projection (hybridlm/ops/gradient_slots.py): the
   projection's gradient equals the one through a plain split, and z's slot held the kernel's write.
The GPU twin of this test is tests/gpu/test_loss_and_norm_kernels_gpu.py.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import interpreter_rounds_like_gpu, interpreter_run_of, kernel_case_row
from hybridlm.ops.elementwise import gated_rms_norm, skip_gated_rms_norm
from hybridlm.ops.gated_norm import gated_norm_skip_reference, norm_then_gate_reference

F32, BF16 = torch.float32, torch.bfloat16
# (leading shape, channels, heads, group size, strided x / z, dtype)
CASES = [
    ((2, 7), 32, 4, 16, True, F32),    # two groups of two heads; 14 rows over 3 programs of 2-row blocks
    ((5,), 16, 2, 16, False, F32),     # one group
    ((3, 3), 32, 2, 8, True, F32),     # a head spans two groups (heads of 16, groups of 8)
    ((2, 5), 32, 4, 16, True, BF16),
]
EPS = 1e-5


def _inputs(case, seed):
    lead, C, H, G, strided, dtype = case
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(*lead, C, generator=g).to(dtype)
    if strided:  # x and z slices of one projection, as in_proj's split gives them
        proj = torch.randn(*lead, 2 * C + 5, generator=g).to(dtype)
        x, z = proj[..., 3:3 + C], proj[..., 3 + C:3 + 2 * C]
    else:
        x, z = torch.randn(*lead, C, generator=g).to(dtype), torch.randn(*lead, C, generator=g).to(dtype)
    D = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    weight = (1 + 0.2 * torch.randn(C, generator=g)).to(dtype)
    dout = torch.randn(*lead, C, generator=g).to(dtype)
    return y, x, D, z, weight, G, dout


def _grads(fn, y, x, D, z, weight, G, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, D, z, weight)]
    out = fn(*leaves, G)
    (out.float() * dout.float()).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _twin(y, x, D, z, w, G):
    return gated_norm_skip_reference(y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), D,
                                     z.reshape(-1, z.shape[-1]), w, EPS, G).view(y.shape)


def _torch_path(y, x, D, z, w, G):
    return skip_gated_rms_norm(y, x, D, z, w, EPS, G, triton=False)


def _loop(y, x, D, z, w, G):
    """Group by group: s = y + D_head x, u = s * silu(z), u / rms(u) * w."""
    C = y.shape[-1]
    hd = C // D.shape[0]
    s = y.double() + x.double() * torch.stack([D[c // hd] for c in range(C)]).double()
    u = s * F.silu(z.double())
    parts = []
    for g0 in range(0, C, G):
        ug = u[..., g0:g0 + G]
        parts.append(ug / torch.sqrt((ug * ug).mean(-1, keepdim=True) + EPS))
    return (torch.cat(parts, -1) * w.double()).to(y.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c[5] == F32], ids=str)
def test_twin_equals_the_torch_path_and_a_loop_over_groups(case):
    inputs = _inputs(case, 0)
    twin = _grads(_twin, *inputs)
    for other in (_torch_path, _loop):
        for a, b in zip(twin, _grads(other, *inputs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# GDN: (leading shape, heads, head_dim, strided z, dtype)
GDN_CASES = [
    ((2, 7), 4, 16, True, F32),   # 14 rows over 3 programs of 2-row blocks
    ((5,), 1, 32, False, F32),    # one head
    ((3, 3), 8, 8, True, F32),
    ((2, 5), 4, 16, True, BF16),
]


def _gdn_inputs(case, seed):
    lead, H, hd, strided, dtype = case
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(*lead, H, hd, generator=g).to(dtype)
    if strided:  # z a column slice of the fused projection, viewed per head
        z = torch.randn(*lead, H * hd + 7, generator=g).to(dtype)[..., 5:5 + H * hd].unflatten(-1, (H, hd))
    else:
        z = torch.randn(*lead, H, hd, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(hd, generator=g)).to(dtype)
    dout = torch.randn(*lead, H, hd, generator=g).to(dtype)
    return y, z, weight, dout


def _gdn_grads(fn, y, z, weight, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (y, z, weight)]
    out = fn(*leaves)
    (out.float() * dout.float()).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _gdn_twin(y, z, w):
    return norm_then_gate_reference(y.reshape(-1, y.shape[-2] * y.shape[-1]),
                                    z.reshape(-1, z.shape[-2] * z.shape[-1]), w, EPS).view(y.shape)


def _gdn_loop(y, z, w):
    """Head by head: y / rms(y) * w * silu(z)."""
    heads = [y[..., h, :].double() for h in range(y.shape[-2])]
    normed = torch.stack([t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS) for t in heads], -2)
    return (normed * w.double() * F.silu(z.double())).to(y.dtype)


@pytest.mark.parametrize("case", [c for c in GDN_CASES if c[4] == F32], ids=str)
def test_gdn_twin_equals_the_torch_path_and_a_loop_over_heads(case):
    inputs = _gdn_inputs(case, 0)
    twin = _gdn_grads(_gdn_twin, *inputs)
    for other in (lambda y, z, w: gated_rms_norm(y, z, w, EPS, triton=False), _gdn_loop):
        for a, b in zip(twin, _gdn_grads(other, *inputs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    from hybridlm.ops.gated_norm import gated_norm_skip
    y = torch.randn(4, 32)
    with pytest.raises(ValueError, match="power of two"):
        gated_norm_skip(y, y, torch.ones(4), y, torch.ones(32), EPS, 12)
    with pytest.raises(ValueError, match="weight \\[32\\]"):
        gated_norm_skip(y, y, torch.ones(4), y, torch.ones(16), EPS, 16)
    from hybridlm.ops.gated_norm import norm_then_gate
    with pytest.raises(ValueError, match="power of two"):
        norm_then_gate(y, y, torch.ones(12), EPS)
    with pytest.raises(ValueError, match="norm_then_gate: y, z must be \\[..., 32\\]"):
        norm_then_gate(y, y[:, :16], torch.ones(16), EPS)


def _slot_rows() -> list:
    """z a block of a projection split by ``split_columns``, its gradient written by the kernel into its slot:
    the projection's gradient against the twin's through a plain split; and whether z's slot held the kernel's
    gradient (written in place, not copied)."""
    from hybridlm.ops.gated_norm import gated_norm_skip, norm_then_gate
    from hybridlm.ops.gradient_slots import GradientSlot, gradient_slot, split_columns
    held, holds = [], GradientSlot.holds
    GradientSlot.holds = lambda self, grad: held.append(holds(self, grad)) or held[-1]  # record, then answer
    rows = []
    for kind, dtype in (("mamba2", F32), ("mamba2", BF16), ("gdn", F32), ("gdn", BF16)):
        g = torch.Generator().manual_seed(7)
        lead, C, H = (2, 9), 32, 4
        proj = torch.randn(*lead, 2 * C + 3, generator=g).to(dtype)
        y = torch.randn(*lead, C, generator=g).to(dtype)
        D, w = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype), (1 + 0.2 * torch.randn(C, generator=g)).to(dtype)
        w = w if kind == "mamba2" else w[:C // H]
        dout = torch.randn(*lead, C, generator=g).to(dtype)
        results = []
        for in_place in (True, False):
            leaves = [t.detach().clone().requires_grad_(True) for t in (proj, y, D, w)]
            P, yy, DD, ww = leaves
            if in_place:
                (x, z, _), _ = split_columns(P, [C, C, 3])
                slot = gradient_slot(z)
            else:
                x, z, _ = P.split([C, C, 3], -1)
            if kind == "mamba2":
                out = (gated_norm_skip(yy, x, DD, z, ww, EPS, 16, slot) if in_place else
                       _twin(yy, x, DD, z, ww, 16))
            else:
                y4, z4 = yy.unflatten(-1, (H, C // H)), z.unflatten(-1, (H, C // H))
                out = (norm_then_gate(y4.flatten(-2), z4.flatten(-2), ww, EPS, slot) if in_place else
                       _gdn_twin(y4, z4, ww).flatten(-2))
            held.clear()
            (out.float() * dout.float()).sum().backward()
            results.append(([out.detach()] + [t.grad for t in leaves if t.grad is not None], list(held)))
        (got, held_in_place), (want, _) = results
        rows.append(kernel_case_row(got, want, kind=kind, bf16=dtype == BF16, held=held_in_place))
    GradientSlot.holds = holds
    return rows


def run_kernel_cases() -> dict:
    from hybridlm.ops.gated_norm import gated_norm_skip, norm_then_gate
    interpreter_rounds_like_gpu()
    rows = {"mamba2": [], "gdn": [], "slots": _slot_rows()}
    for seed, case in enumerate(CASES):
        inputs = _inputs(case, seed)
        want = _grads(_twin, *inputs)
        got = _grads(lambda y, x, D, z, w, G: gated_norm_skip(y, x, D, z, w, EPS, G), *inputs)
        rows["mamba2"].append(kernel_case_row(got, want, case=repr(case), bf16=case[5] == BF16))
    for seed, case in enumerate(GDN_CASES):
        inputs = _gdn_inputs(case, seed)
        want = _gdn_grads(_gdn_twin, *inputs)
        got = _gdn_grads(lambda y, z, w: norm_then_gate(y.flatten(-2), z.flatten(-2), w, EPS).view(y.shape), *inputs)
        rows["gdn"].append(kernel_case_row(got, want, case=repr(case), bf16=case[4] == BF16))
    return rows


interpreter_run = interpreter_run_of(__file__)


def test_kernels_equal_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run["mamba2"]) == len(CASES)
    for r in interpreter_run["mamba2"]:
        assert r["dtypes_ok"] and r["n"] == 6, r  # out, dy, dx, dD, dz, dw
        # bf16: within a rounding of the fp32-math twin (dD and dw sum over rows)
        assert max(r["errors"]) < (1e-5 if not r["bf16"] else 3e-2), r


def test_gdn_kernels_equal_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run["gdn"]) == len(GDN_CASES)
    for r in interpreter_run["gdn"]:
        assert r["dtypes_ok"] and r["n"] == 4, r  # out, dy, dz, dw
        assert max(r["errors"]) < (1e-5 if not r["bf16"] else 3e-2), r


def test_z_gradient_written_into_its_slot_equals_the_split_one(interpreter_run):
    rows = interpreter_run["slots"]
    assert [(r["kind"], r["bf16"]) for r in rows] == [("mamba2", False), ("mamba2", True), ("gdn", False),
                                                      ("gdn", True)]
    for r in rows:
        # z's gradient is in place; x's (Mamba2's skip) is copied in; GDN's x and the last block are unused (None:
        # zeroed without a look)
        assert r["held"] == ([False, True] if r["kind"] == "mamba2" else [True]), r
        # out, and the gradients of the projection, y, (D,) the weight
        assert r["dtypes_ok"] and r["n"] == (5 if r["kind"] == "mamba2" else 4), r
        assert max(r["errors"]) < (1e-5 if not r["bf16"] else 3e-2), r


if __name__ == "__main__":  # python tests/test_gated_norm.py -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases()))
