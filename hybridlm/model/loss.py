"""Causal-LM cross-entropy that never materialises the full ``[tokens, vocab]`` logits.

:class:`ChunkedLinearHead` walks the tokens in contiguous chunks and computes each chunk's gradient
during the forward pass, so at most one chunk of logits exists at a time. Per chunk:

* logits = hidden @ weight.T in the activations' dtype (bf16 GEMM on tensor cores in training);
* the loss and d loss / d logits = (softmax - onehot) / n_valid: one Triton kernel on GPU that writes the
  gradient over the chunk's logits (hybridlm/ops/cross_entropy.py; fla's fused cross-entropy with
  ``runtime.loss_kernel: fla``), torch ops on CPU;
* grad_hidden = dlogits @ weight (through a transposed copy of the weight, so that both operands run along
  the vocabulary) and grad_weight += dlogits.T @ hidden: GEMMs in the activations' dtype, the weight gradient
  summed over chunks in fp32.

Why not fla's own ``FusedLinearCrossEntropyLoss``: it accumulates the weight gradient through ``addmm`` on
fp32 copies of the logits and the hidden states, which cuBLAS runs as an fp32 SIMT GEMM (no TF32 by
default): 55 % of a GDN-300M training step on an H200 (BENCHMARKS.md, "Training throughput").
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridlm.ops.cross_entropy import cross_entropy_kernel

IGNORE_INDEX = -100


def add_product_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc``. bf16 ``a``, ``b`` on CUDA: one GEMM that accumulates into ``acc`` in its
    epilogue. The bf16 product, its fp32 copy and the add cost two more passes over the [vocab, hidden] weight
    gradient per chunk (BENCHMARKS.md, "The GEMMs by shape (GDN-300M)", the head's weight gradient)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


class ChunkedLinearHead(torch.autograd.Function):
    """The one chunked loop of every loss over the vocabulary (cross-entropy here, KD's KL in
    ``distill/kd_loss.py``, SMART's KL measurement through it): ``logits = hidden @ weight.T`` one chunk of rows
    at a time, in the activations' dtype; ``chunk_loss(logits, rows, need_grad)`` returns the chunk's share of
    the loss (fp32) and d loss / d logits (None without ``need_grad``), which is folded into the hidden-state and
    weight gradients right away (the weight's summed in fp32). Gradients flow to ``hidden`` and ``weight``."""

    @staticmethod
    def forward(ctx, hidden, weight, chunk_loss: Callable, chunk_rows: int, grad_enabled: bool = True):
        # the forward runs without grad mode, so the caller's (an evaluation under no_grad) comes as an argument
        need_grad = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        total = hidden.new_zeros((), dtype=torch.float32)
        w = weight.to(hidden.dtype)
        # the input gradient's GEMM sums over the vocabulary: with the weight transposed once, both of its operands
        # are contiguous along that sum (K-major), which cuBLAS ran 19 % faster than the [vocab, hidden] layout at
        # the 300M models' head on an H200 (BENCHMARKS.md, "Training step breakdown"); costs one weight-sized copy
        # meanwhile
        w_k_major = w.t().contiguous() if need_grad else None
        size = max(1, int(chunk_rows))
        for start in range(0, hidden.shape[0], size):
            h = hidden[start:start + size]
            loss, dlogits = chunk_loss(h @ w.t(), slice(start, start + h.shape[0]), need_grad)
            total = total + loss
            if need_grad:
                dlogits = dlogits.to(h.dtype)
                torch.mm(dlogits, w_k_major.t(), out=grad_hidden[start:start + size])
                add_product_fp32(grad_weight, dlogits.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None


class CrossEntropyChunk:
    """Per-chunk mean token cross-entropy for :class:`ChunkedLinearHead`: loss and d (loss / n_valid) / d logits,
    written over the chunk's logits: a Triton kernel (``triton``: the project's or fla's, as ``loss_kernel``
    says, the model's ``runtime.loss_kernel``) or torch ops."""

    def __init__(self, labels: torch.Tensor, triton: bool = False, loss_kernel: str = "project"):
        self.labels, self.triton, self.loss_kernel = labels, triton, loss_kernel
        self.inv_n = (labels != IGNORE_INDEX).sum().clamp(min=1).float().reciprocal()

    def __call__(self, logits: torch.Tensor, rows: slice, need_grad: bool):
        target, inv_n = self.labels[rows], self.inv_n
        if self.triton and self.loss_kernel == "project":
            # one kernel: the losses, and the gradient written over this chunk's logits (which are ours)
            losses = cross_entropy_kernel(logits, target, inv_n, write_grad=need_grad, ignore_index=IGNORE_INDEX)
            return losses.sum() * inv_n, (logits if need_grad else None)
        if self.triton:
            from fla.modules.fused_cross_entropy import cross_entropy_loss

            if not need_grad:
                return cross_entropy_loss(logits, target, ignore_index=IGNORE_INDEX)[0].sum() * inv_n, None
            with torch.enable_grad():
                leaf = logits.detach().requires_grad_()
                losses = cross_entropy_loss(leaf, target, ignore_index=IGNORE_INDEX, inplace_backward=True)[0]
                (grad,) = torch.autograd.grad(losses, leaf, grad_outputs=inv_n.expand_as(losses))
            return losses.sum() * inv_n, grad
        valid = target != IGNORE_INDEX
        safe = target.masked_fill(~valid, 0).unsqueeze(-1)
        logits32 = logits.float()
        lse = torch.logsumexp(logits32, dim=-1, keepdim=True)
        loss = ((lse - logits32.gather(-1, safe)).squeeze(-1) * valid).sum() * inv_n
        if not need_grad:
            return loss, None
        probs = logits32.sub_(lse).exp_()  # in place: one fp32 chunk alive
        probs.scatter_add_(-1, safe, -torch.ones_like(safe, dtype=probs.dtype))
        probs.mul_((valid.to(probs.dtype) * inv_n).unsqueeze(-1))
        return loss, probs.to(logits.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         num_chunks: int = 8, triton: bool = False, loss_kernel: str = "project") -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored).

    hidden ``[N, d]``, weight ``[V, d]``, labels ``[N]`` (already aligned: label i is the target of row i).
    ``triton``: a Triton cross-entropy kernel per chunk (CUDA, or the Triton interpreter): the project's
    (``loss_kernel="project"``) or fla's fused cross-entropy (``"fla"``).
    """
    rows = -(-hidden.shape[0] // max(1, num_chunks))
    return ChunkedLinearHead.apply(hidden, weight, CrossEntropyChunk(labels, triton, loss_kernel), rows,
                                   torch.is_grad_enabled())
