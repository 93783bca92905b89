"""Token cross-entropy and its gradient over one chunk of logits, in one Triton kernel.

The chunked LM-head loss (hybridlm/model/loss.py) needs, per chunk of ``[rows, vocab]`` logits, each row's loss
and ``d loss / d logits = (softmax - onehot) * scale`` before the chunk's GEMMs fold that gradient into the hidden
states' and the head's. fla's kernel (fla/modules/fused_cross_entropy) does it in two launches: the forward reads
the logits for the log-sum-exp, then autograd runs its backward, which reads them again and writes the gradient.
At 131k tokens and Llama-3's 128,256-word vocabulary that is 34 GB read twice and written once per step
(BENCHMARKS.md, "Non-GEMM kernels alone", the LM-head cross-entropy against fla's and the memory floor).

Here one program per row computes the log-sum-exp in one sweep (an online max and sum per lane), then sweeps the
row again to write the gradient over the logits in place. A row is 256 KB in bf16: with ~2,000 rows in flight on
an H200 the second sweep reads HBM again, so three passes over the chunk bound it, not the two of its floor.
No loop over rows: a bounded number of programs could keep their rows within L2 for the second sweep, but with
one to four programs an SM that is 1.5-2.8x slower (too few loads in flight), and even at one row per program
the loop slows the training step. A one-exp online update of the first sweep has been measured only together
with that loop, so its own effect is unknown.

:func:`cross_entropy_reference` is the torch twin the tests hold the kernel to.
"""
from __future__ import annotations

import torch

from hybridlm.ops.triton_launch import interpreting, load_triton

tl = None  # triton.language, bound by load_triton(globals()) on first use (hybridlm/ops/triton_launch.py)
_KERNEL = None
# columns per sweep step and warps (not autotuned: the kernel writes over its input, so the autotuner's repeated
# runs would need a copy of the chunk, GiBs at the training shapes); benchmarks/kernel_bench.py sweeps them.
# 2048 x 4 is the fastest of the tilings swept alone, and beats 4096 x 8 in GDN-300M's step too (BENCHMARKS.md,
# "Non-GEMM kernels alone").
BLOCK_V, NUM_WARPS = 2048, 4


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                            ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin: per-row losses (fp32, 0 where ignored) and ``(softmax - onehot) * scale`` (0 where
    ignored) in the logits' dtype; fp32 math."""
    valid = target != ignore_index
    safe = target.masked_fill(~valid, 0).unsqueeze(-1)
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    losses = (lse - x.gather(-1, safe)).squeeze(-1) * valid
    grad = (x - lse).exp().scatter_add(-1, safe, -torch.ones_like(safe, dtype=torch.float32))
    grad = grad * (valid.float() * scale.float()).unsqueeze(-1)
    return losses, grad.to(logits.dtype)


def _cross_entropy_kernel(logits, target, losses, scale, V, s_row, IGNORE: tl.constexpr, BV: tl.constexpr,
                          WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = logits + row * s_row
    o = tl.arange(0, BV)
    # sweep 1: per lane a running max and the sum of exp(x - max); finite start so an all-masked lane stays 0
    m = tl.full([BV], -1e30, dtype=tl.float32)
    acc = tl.zeros([BV], dtype=tl.float32)
    for v0 in range(0, V, BV):
        x = tl.load(p + v0 + o, mask=v0 + o < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        acc = acc * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(acc * tl.exp(m - m_row), 0))
    label = tl.load(target + row)
    valid = label != IGNORE
    safe = tl.where(valid, label, 0)
    x_label = tl.load(p + safe).to(tl.float32)
    tl.store(losses + row, tl.where(valid, lse - x_label, 0.0))
    if WRITE_GRAD:
        # sweep 2: the gradient over the logits, in place
        sc = tl.where(valid, tl.load(scale).to(tl.float32), 0.0)
        for v0 in range(0, V, BV):
            cols = v0 + o
            x = tl.load(p + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * sc - tl.where(cols == safe, sc, 0.0)
            tl.store(p + cols, g.to(logits.dtype.element_ty), mask=cols < V)


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        triton = load_triton(globals())
        _KERNEL = triton.jit(_cross_entropy_kernel)
    return _KERNEL


def cross_entropy_kernel(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, write_grad: bool,
                         ignore_index: int = -100) -> torch.Tensor:
    """Per-row token cross-entropy of ``logits [R, V]`` (rows contiguous) against ``target [R]``: fp32 losses, 0
    where ``target == ignore_index``. With ``write_grad``, the logits are overwritten by
    ``(softmax - onehot) * scale`` (``scale``: a one-element tensor, e.g. 1 / the valid tokens of the batch; 0 on
    ignored rows), so the caller must own them."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or target.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: logits must be [R, V] with contiguous rows and target [R], got "
                         f"{tuple(logits.shape)} (strides {logits.stride()}) and {tuple(target.shape)}")
    R, V = logits.shape
    losses = torch.empty(R, dtype=torch.float32, device=logits.device)
    block, warps = (16, 1) if interpreting() else (BLOCK_V, NUM_WARPS)
    _kernel()[(R,)](logits, target.contiguous(), losses, scale.reshape(1).float(), V, logits.stride(0),
                    IGNORE=ignore_index, BV=block, WRITE_GRAD=write_grad, num_warps=warps)
    return losses
