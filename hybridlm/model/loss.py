"""Causal-LM cross-entropy that never materialises the full ``[tokens, vocab]`` logits.

GPU: fla's ``FusedLinearCrossEntropyLoss`` (Triton). CPU: :class:`ChunkedLinearCrossEntropy`, which
walks the tokens in chunks and computes each chunk's gradient during the forward pass, so at most one
chunk of logits exists at a time (same idea, torch ops).
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, num_chunks: int):
        n_valid = (labels != IGNORE_INDEX).sum().clamp(min=1)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        total = hidden.new_zeros((), dtype=torch.float32)
        for idx in torch.arange(hidden.shape[0], device=hidden.device).chunk(num_chunks):
            h, y = hidden[idx], labels[idx]
            logits = (h @ weight.t()).float()
            valid = y != IGNORE_INDEX
            target = y.masked_fill(~valid, 0).unsqueeze(-1)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            total = total + ((lse - logits.gather(-1, target)).squeeze(-1) * valid).sum()
            if need_grad:  # d loss / d logits = (softmax - onehot) / n_valid, built in place
                probs = logits.sub_(lse).exp_()
                probs.scatter_add_(-1, target, -torch.ones_like(target, dtype=probs.dtype))
                probs.mul_((valid.to(probs.dtype) / n_valid).unsqueeze(-1))
                grad_hidden[idx] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
                grad_weight.addmm_(probs.t(), h.float())
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         num_chunks: int = 8, triton: bool = False) -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored).

    hidden ``[N, d]``, weight ``[V, d]``, labels ``[N]`` (already aligned: label i is the target of row i).
    """
    if triton:
        from fla.modules import FusedLinearCrossEntropyLoss
        return FusedLinearCrossEntropyLoss(num_chunks=num_chunks)(hidden, labels, weight)
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, num_chunks)
