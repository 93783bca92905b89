"""A projection's output split into column blocks, its gradient assembled where the blocks' consumers write it.

A mixer's fused projection (hybridlm/model/layers/projections.py; Mamba2's ``in_proj``) is one GEMM whose output
is split into column blocks (GDN: q | k | v, beta, decay, gate; Mamba2: z, x | B | C, dt). Through ``split``,
autograd assembles the output's gradient by concatenating the blocks' gradients: one more full-size write and
read a layer, ``CatArrayBatchedCopy`` in a profile, more of it for Mamba2's wider projection than for GDN's
(BENCHMARKS.md, "Switches", ``runtime.projection_grads_in_place``).

:func:`split_columns` splits the same way and gives each block a :class:`GradientSlot`: that block's columns of
one gradient buffer, made when first asked for. A consumer whose backward writes its input's gradient itself (the
project's short conv and gated norm kernels) writes it into the slot; the split's backward then finds the blocks'
gradients already in place and returns the buffer, copying only the blocks whose gradient arrived elsewhere (a
consumer that does not know slots, a gradient summed over two uses) and zeroing those with none. The values are
the concatenation's, whoever wrote them.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

_SLOT_ATTR = "_gradient_slot"


class _Buffer:
    """The split tensor's gradient, made on first use (in the backward)."""

    def __init__(self, like: torch.Tensor):
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.tensor: Optional[torch.Tensor] = None

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.tensor


class GradientSlot:
    """Where one column block's gradient goes: columns ``[start, start + width)`` of the split's gradient buffer."""

    def __init__(self, buffer: _Buffer, start: int, width: int):
        self.buffer, self.start, self.width = buffer, start, width

    def tensor(self) -> torch.Tensor:
        """The block's columns of the buffer: a view, rows strided by the whole width (write the gradient here)."""
        return self.buffer.get()[..., self.start:self.start + self.width]

    def holds(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is this slot's view (written in place by a consumer), in any shape of the same rows."""
        if self.buffer.tensor is None:
            return False
        view = self.tensor()
        if grad.data_ptr() != view.data_ptr() or grad.numel() != view.numel():
            return False
        rows = grad.reshape(view.shape)  # a view when grad's layout allows one, else a copy (elsewhere)
        return rows.data_ptr() == view.data_ptr() and rows.stride() == view.stride()


def gradient_slot(block: Optional[torch.Tensor]) -> Optional[GradientSlot]:
    """The slot :func:`split_columns` gave ``block`` (the very tensor it returned), or None."""
    return getattr(block, _SLOT_ATTR, None)


def gradient_into(slot: Optional[GradientSlot], shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a consumer's backward writes its input's gradient (``shape``, ``dtype``): the slot's view when it has
    that shape and dtype, else a new contiguous tensor."""
    if slot is not None:
        view = slot.tensor()
        if view.shape == tuple(shape) and view.dtype == dtype:
            return view
    return torch.empty(shape, dtype=dtype, device=device)


class _SplitColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, widths, slots):
        ctx.slots = slots
        ctx.set_materialize_grads(False)  # an unused block's gradient comes as None: zeros in its slot
        return tuple(y.split(list(widths), dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        slots = ctx.slots
        out = slots[0].buffer.get()
        for slot, grad in zip(slots, grads):
            if grad is None:
                slot.tensor().zero_()
            elif not slot.holds(grad):
                view = slot.tensor()
                view.copy_(grad.reshape(view.shape))
        slots[0].buffer.tensor = None  # a second backward through a kept graph assembles into a new buffer
        return out, None, None


def split_columns(y: torch.Tensor, widths: Sequence[int]) -> Tuple[List[torch.Tensor], List[GradientSlot]]:
    """``y.split(widths, -1)`` whose backward assembles ``y``'s gradient in one buffer that consumers may write into
    (module docstring). Each block carries its slot (:func:`gradient_slot`); also returned in order."""
    widths = [int(w) for w in widths]
    if sum(widths) != y.shape[-1]:
        raise ValueError(f"split_columns: widths {widths} must add up to the last dim {y.shape[-1]}")
    buffer = _Buffer(y)
    starts = [sum(widths[:j]) for j in range(len(widths))]
    slots = [GradientSlot(buffer, s, w) for s, w in zip(starts, widths)]
    blocks = list(_SplitColumns.apply(y, tuple(widths), slots))
    for block, slot in zip(blocks, slots):
        setattr(block, _SLOT_ATTR, slot)
    return blocks, slots
