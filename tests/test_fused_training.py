"""The training-time fusions (docs/design.md, "Fused training paths"), CPU: each computes the function it
replaces, values and gradients.

1. ``project`` / ``fused_linear`` (hybridlm/model/layers/projections.py): one GEMM over concatenated weights
   against the separate linears, with and without bias; not fused outside autograd or for a hooked linear.
2. GDN, KDA and the SwiGLU MLP with ``fuse_projections`` on against off (same weights), and the whole model with
   both fusions (``fuse_residual_norm`` too) against neither: loss and every parameter's gradient.
3. The packed SwiGLU (hybridlm/ops/swiglu_packed.py): its torch twin against ``swiglu`` of the two halves, and its
   Triton kernels through the interpreter (``TRITON_INTERPRET=1``, a subprocess) against the twin, fp32 and bf16,
   with rows strided as a slice of a wider tensor.
"""
import json

import pytest
import torch
from torch import nn

from conftest import interpreter_rounds_like_gpu, interpreter_run_of, max_rel_err, tiny_config
from hybridlm.model import HybridForCausalLM
from hybridlm.model.layers.projections import fused_linear, project
from hybridlm.ops.elementwise import swiglu, swiglu_packed
from hybridlm.ops.swiglu_packed import swiglu_packed_reference


def _linears(bias: bool, sizes=(5, 7, 3)):
    torch.manual_seed(0)
    return [nn.Linear(6, n, bias=bias) for n in sizes]


def _grads(outputs, leaves, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outputs)
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_project_fused_equals_the_separate_linears(bias):
    linears = _linears(bias)
    x = torch.randn(2, 4, 6, requires_grad=True)
    leaves = [x] + [p for m in linears for p in m.parameters()]
    fused, separate = project(x, linears, fuse=True), project(x, linears, fuse=False)
    assert fused[0]._base is not None and fused[0]._base.shape[-1] == 15  # views of one GEMM's output
    for a, b in zip(fused, separate):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads(fused, leaves), _grads(separate, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_project_joins_the_first_outputs_into_one_view_only_where_fused():
    linears = _linears(False)
    x = torch.randn(2, 4, 6, requires_grad=True)
    joined = project(x, linears, fuse=True, join_first=2)
    separate = project(x, linears, fuse=False, join_first=2)  # unfused: the join does not apply
    assert [t.shape[-1] for t in joined] == [12, 3] and [t.shape[-1] for t in separate] == [5, 7, 3]
    torch.testing.assert_close(joined[0], torch.cat(separate[:2], -1), rtol=1e-6, atol=1e-6)
    leaves = [x] + [m.weight for m in linears]
    for a, b in zip(_grads(joined, leaves), _grads([torch.cat(separate[:2], -1), separate[2]], leaves)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_linear_applies_only_where_it_is_the_same_call():
    linears = _linears(False)
    x = torch.randn(3, 6)
    assert fused_linear(x, linears) is not None
    with torch.no_grad():  # generation: the concatenation would copy the weights at every step
        assert fused_linear(x, linears) is None
    assert fused_linear(x, linears[:1]) is None
    mixed = _linears(False) + [nn.Linear(6, 2, bias=True)]
    assert fused_linear(x, mixed) is None
    linears[1].register_forward_hook(lambda *a: None)  # a hook expects its module's own call
    assert fused_linear(x, linears) is None


def _train_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(pattern, mixer, **keys):
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config(pattern, mixer=mixer, **keys)).train()
    with torch.no_grad():  # norm weights off 1, so that which norm sees which input matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("pattern,mixer", [("G-", "gdn"), ("K-", "kda"), ("*-G-K-S-", "gdn")],
                         ids=["gdn_mlp", "kda_mlp", "every_kind"])
def test_fused_training_step_equals_the_unfused_one(pattern, mixer):
    ids = torch.randint(1, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    fused = _model(pattern, mixer)
    plain = _model(pattern, mixer, fuse_residual_norm=False, fuse_projections=False)
    plain.load_state_dict(fused.state_dict())
    assert fused.model._residual_adds_in_norms() and not plain.model._residual_adds_in_norms()
    loss_f, grads_f = _train_grads(fused, ids)
    loss_p, grads_p = _train_grads(plain, ids)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-6, atol=1e-6)
    assert grads_f.keys() == grads_p.keys() and len(grads_f) == len(list(fused.parameters()))
    for name in grads_f:
        torch.testing.assert_close(grads_f[name], grads_p[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpointing_and_hooks_keep_the_block_loop():
    model = _model("G-", "gdn")
    assert model.model._residual_adds_in_norms()
    model.activation_checkpointing_enable()
    assert not model.model._residual_adds_in_norms()
    model.activation_checkpointing_disable()
    model.model.layers[1].register_forward_hook(lambda *a: None)
    assert not model.model._residual_adds_in_norms()
    assert not model.eval().model._residual_adds_in_norms()  # inference: only inside the scoped switch


def test_swiglu_packed_twin_equals_swiglu_of_the_halves():
    y = torch.randn(3, 5, 16, requires_grad=True)
    twin, path = swiglu_packed_reference(y), swiglu_packed(y)
    gate, up = y.chunk(2, -1)
    torch.testing.assert_close(twin, swiglu(gate, up), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(path, twin, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads([twin], [y]), _grads([path], [y])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# (rows, F, dtype, strided rows)
KERNEL_CASES = [(7, 24, torch.float32, False), (33, 40, torch.float32, True), (9, 24, torch.bfloat16, True)]


def run_kernel_cases() -> list:
    from hybridlm.ops.swiglu_packed import swiglu_packed_kernel
    interpreter_rounds_like_gpu()
    rows = []
    for seed, (R, F, dtype, strided) in enumerate(KERNEL_CASES):
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(2, R, 2 * F + (6 if strided else 0), generator=g).to(dtype)
        y = full[..., 2:2 + 2 * F] if strided else full
        dz = torch.randn(2, R, F, generator=g).to(dtype)
        out = {}
        for name, fn in (("kernel", swiglu_packed_kernel), ("twin", swiglu_packed_reference)):
            leaf = y.detach().clone().requires_grad_(True)
            z = fn(leaf)
            z.backward(dz)
            out[name] = (z.detach(), leaf.grad)
        errs = [max_rel_err(a, b) for a, b in zip(out["kernel"], out["twin"])]
        rows.append({"case": f"{R}x{F} {dtype} strided={strided}", "bf16": dtype == torch.bfloat16, "errors": errs,
                     "shapes_ok": all(a.shape == b.shape and a.dtype == b.dtype
                                      for a, b in zip(out["kernel"], out["twin"]))})
    return rows


interpreter_run = interpreter_run_of(__file__)


def test_packed_swiglu_kernels_equal_the_twin_in_the_interpreter(interpreter_run):
    assert len(interpreter_run) == len(KERNEL_CASES)
    for r in interpreter_run:
        assert r["shapes_ok"], r
        # fp32: the same fp32 math; bf16: z within a rounding of the twin (which also rounds once from fp32)
        assert max(r["errors"]) < (1e-6 if not r["bf16"] else 1e-2), r


if __name__ == "__main__":  # python tests/test_fused_training.py -> one JSON line (TRITON_INTERPRET=1)
    print(json.dumps(run_kernel_cases()))
