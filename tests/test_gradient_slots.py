"""hybridlm/ops/gradient_slots.py, CPU: a projection split into column blocks whose gradient is assembled where the
blocks' consumers write it. Whatever the consumers do (write into the slot, return a gradient of their own, use a
block twice, not use it), the projection's gradient is the concatenation's, and a consumer that writes into its
slot is not copied: the gradient the projection receives is the slots' buffer."""
import pytest
import torch

from hybridlm.ops.gradient_slots import GradientSlot, gradient_into, gradient_slot, split_columns

WIDTHS = [3, 5, 2, 4]


class _ScaleIntoSlot(torch.autograd.Function):
    """A consumer that writes its input's gradient (2 * its output's) into the input's slot, as the project's
    conv and norm kernels do."""

    @staticmethod
    def forward(ctx, x, slot):
        ctx.slot, ctx.meta = slot, (x.shape, x.dtype, x.device)
        return 2 * x

    @staticmethod
    def backward(ctx, dy):
        dx = gradient_into(ctx.slot, *ctx.meta)
        dx.copy_(2 * dy)
        return dx, None


def _consumers(blocks, through_slot: bool):
    """Block 0 through the slot-writing consumer (or the same function without its slot), block 1 used twice,
    block 2 not at all, block 3 by a plain op."""
    a, b, _, d = blocks
    first = _ScaleIntoSlot.apply(a, gradient_slot(a) if through_slot else None)
    return [first.sin(), (b * b).cos() + b.exp(), d.tanh()]


def _run(split_kind: str, y0: torch.Tensor, retain: bool = False):
    y = y0.clone().requires_grad_(True)
    seen = []
    pre = y * 1.0  # the split tensor is not a leaf in a model either (a GEMM's output)
    pre.register_hook(lambda g: seen.append(g))
    if split_kind == "slots":
        blocks, slots = split_columns(pre, WIDTHS)
    else:
        blocks, slots = list(pre.split(WIDTHS, -1)), None
    outs = _consumers(blocks, through_slot=split_kind == "slots")
    loss = sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs)
    loss.backward(retain_graph=retain)
    return y, seen, slots, loss


def test_assembled_gradient_equals_the_concatenation_and_the_writing_consumer_is_not_copied(monkeypatch):
    y0 = torch.randn(2, 6, sum(WIDTHS), generator=torch.Generator().manual_seed(0))
    copies = []
    holds = GradientSlot.holds
    monkeypatch.setattr(GradientSlot, "holds", lambda self, g: copies.append((self.start, holds(self, g))) or
                        copies[-1][1])
    y, seen, slots, _ = _run("slots", y0)
    plain, _, _, _ = _run("split", y0)
    torch.testing.assert_close(y.grad, plain.grad, rtol=0, atol=0)
    assert y.grad[..., 8:10].abs().sum() == 0  # block 2, unused: zeros
    # block 0 was written in place (its slot held it), blocks 1 and 3 came as tensors of their own and were copied;
    # block 2 had no gradient to look at
    assert copies == [(0, True), (3, False), (10, False)]
    assert seen[0].shape == y0.shape and seen[0].stride() == y0.stride()  # one contiguous buffer, as a cat's
    assert [s.tensor().shape[-1] for s in slots] == WIDTHS


def test_the_written_slot_is_the_gradient_the_projection_receives():
    y0 = torch.randn(4, sum(WIDTHS))
    y = y0.clone().requires_grad_(True)
    received, written = [], []
    pre = y * 1.0
    pre.register_hook(lambda g: received.append(g.data_ptr()))
    blocks, slots = split_columns(pre, WIDTHS)

    class _Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, dy):
            dx = gradient_into(slots[0], dy.shape, dy.dtype, dy.device)
            dx.copy_(dy)
            written.append(dx.data_ptr())
            return dx
    sum(b.sum() for b in [_Record.apply(blocks[0]), *blocks[1:]]).backward()
    assert received == written  # block 0's columns start the buffer: its view and the buffer share a pointer
    torch.testing.assert_close(y.grad, torch.ones_like(y0))


def test_a_kept_graph_assembles_its_second_gradient_in_a_new_buffer():
    y0 = torch.randn(2, 3, sum(WIDTHS))
    y, seen, _, loss = _run("slots", y0, retain=True)
    first = y.grad.clone()
    loss.backward()
    torch.testing.assert_close(y.grad, 2 * first)
    assert seen[0].data_ptr() != seen[1].data_ptr()


def test_gradient_into_falls_back_where_the_slot_does_not_fit_and_bad_widths_are_named():
    blocks, slots = split_columns(torch.randn(2, sum(WIDTHS), requires_grad=True), WIDTHS)
    assert gradient_slot(blocks[1]) is slots[1] and gradient_slot(torch.randn(2)) is None
    fits = gradient_into(slots[1], (2, 5), torch.float32, torch.device("cpu"))
    assert fits.data_ptr() == slots[1].tensor().data_ptr() and fits.stride() == (sum(WIDTHS), 1)
    other = gradient_into(slots[1], (2, 4), torch.float32, torch.device("cpu"))  # another shape: a tensor of its own
    assert other.is_contiguous() and other.data_ptr() != slots[1].tensor().data_ptr()
    assert gradient_into(None, (3,), torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"split_columns: widths \[3, 5\] must add up to the last dim 14"):
        split_columns(torch.randn(2, 14), [3, 5])
