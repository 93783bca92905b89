"""The KD loss: ``kl_weight * mean_t KL(p_teacher || p_student) + ce_weight * mean_t CE(student, label)`` over
the supervised tokens (see ``distill/kd.py`` for the stage and its settings), and SMART's KL measurement
through the same loop.

Memory: neither model's ``[tokens, vocab]`` logits exist whole. Both models contribute their final hidden
states and LM-head weights; :class:`hybridlm.model.loss.ChunkedLinearHead` walks the supervised tokens in
chunks of ``chunk_tokens`` and :class:`KDChunk` computes, per chunk, both models' logits, the KL / CE sums and
the gradient with respect to the student's logits, folded straight into the hidden-state and weight gradients.
The result does not depend on the chunk size beyond float summation order. On the Triton path the per-chunk
arithmetic (both softmaxes, KL, CE and the gradient) is one kernel, ``hybridlm/ops/kd_divergence.py``, held to
the torch ops below by its tests (fla's ``FusedKLDivLoss`` is not used: it has no CE term and no temperature).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridForCausalLM
from hybridlm.model.loss import IGNORE_INDEX, ChunkedLinearHead
from hybridlm.ops.backend import use_triton
from hybridlm.ops.kd_divergence import kd_divergence_kernel


# ------------------------------------------------------------------------------------- loss
class KDChunk:
    """Per-chunk KD loss for :class:`hybridlm.model.loss.ChunkedLinearHead`: ``kl_weight * KL(softmax(t/T) ||
    softmax(s/T)) + ce_weight * CE(s, y)`` over the chunk's rows, divided by the number of rows, with the
    teacher's logits ``t = ht @ wt.T`` made here one chunk at a time; the unweighted KL and CE sums are kept in
    ``kl_sum`` / ``ce_sum`` (fp32, no gradient). ``triton``: the chunk's arithmetic in one kernel
    (:func:`hybridlm.ops.kd_divergence.kd_divergence_kernel`, which writes the gradient over the chunk's logits)."""

    def __init__(self, ht, wt, targets, temperature: float, kl_weight: float, ce_weight: float,
                 triton: bool = False):
        self.ht, self.wt, self.targets, self.triton = ht, wt, targets, triton
        self.temperature = float(temperature)
        self.inv_t, self.kl_weight, self.ce_weight = 1.0 / float(temperature), float(kl_weight), float(ce_weight)
        self.denom = max(targets.shape[0], 1)
        self.kl_sum = torch.zeros((), dtype=torch.float32, device=ht.device)
        self.ce_sum = torch.zeros((), dtype=torch.float32, device=ht.device)

    def __call__(self, logits: torch.Tensor, rows: slice, need_grad: bool):
        if self.triton:
            return self._kernel_chunk(logits, rows, need_grad)
        s, y, inv_t = logits.float(), self.targets[rows], self.inv_t
        with torch.no_grad():
            log_pt = F.log_softmax((self.ht[rows] @ self.wt.t()).float() * inv_t, dim=-1)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        log_ps = F.log_softmax(s * inv_t, dim=-1) if inv_t != 1.0 else s - lse
        pt = log_pt.exp()
        kl = (pt * (log_pt - log_ps)).sum()
        ce = (lse.squeeze(-1) - s.gather(-1, y.unsqueeze(-1)).squeeze(-1)).sum()
        self.kl_sum += kl.detach()
        self.ce_sum += ce.detach()
        loss = (self.kl_weight * kl + self.ce_weight * ce) / self.denom
        if not need_grad:
            return loss, None
        # d/ds: kl_weight (softmax(s/T) - p_t) / T / n  +  ce_weight (softmax(s) - onehot(y)) / n
        g = log_ps.exp_().sub_(pt).mul_(self.kl_weight * inv_t / self.denom)
        if self.ce_weight:
            p1 = s.sub_(lse).exp_()
            p1.scatter_add_(-1, y.unsqueeze(-1), -torch.ones_like(y, dtype=p1.dtype).unsqueeze(-1))
            g.add_(p1, alpha=self.ce_weight / self.denom)
        return loss, g

    def _kernel_chunk(self, logits: torch.Tensor, rows: slice, need_grad: bool):
        with torch.no_grad():
            teacher_logits = (self.ht[rows] @ self.wt.t()).to(logits.dtype)
        kl, ce = kd_divergence_kernel(logits, teacher_logits, self.targets[rows], self.temperature, self.kl_weight,
                                      self.ce_weight, 1.0 / self.denom, write_grad=need_grad)
        kl, ce = kl.sum(), ce.sum()
        self.kl_sum += kl
        self.ce_sum += ce
        return (self.kl_weight * kl + self.ce_weight * ce) / self.denom, (logits if need_grad else None)


@torch.no_grad()
def kl_sum(hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor, chunk_tokens: int = 1024) -> float:
    """Summed KL(softmax(ht wt^T) || softmax(hs ws^T)) over the rows (nats), through the same chunked loop as
    the KD loss: one chunk of both models' logits at a time, neither model's full log-probabilities ever."""
    if hs.shape[0] != ht.shape[0]:
        raise ValueError(f"kl: {hs.shape[0]} student rows vs {ht.shape[0]} teacher rows")
    if hs.shape[0] == 0:
        return 0.0
    zeros = torch.zeros(hs.shape[0], dtype=torch.long, device=hs.device)  # no CE: its weight is 0
    chunk = KDChunk(ht.to(hs.device), wt.detach().to(hs.device), zeros, 1.0, 1.0, 0.0,
                    triton=use_triton("auto", hs))
    ChunkedLinearHead.apply(hs, ws.detach(), chunk, int(chunk_tokens), False)
    return float(chunk.kl_sum)


def final_hidden(model, input_ids: torch.LongTensor) -> torch.Tensor:
    """Last-layer (final-norm) hidden states ``(B, T, d)`` of a HybridForCausalLM or a transformers causal LM."""
    if isinstance(model, HybridForCausalLM):
        return model.model(input_ids=input_ids)
    out = model.model(input_ids=input_ids, use_cache=False)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def kd_loss(student, teacher, batch: Dict[str, torch.Tensor], kl_weight: float = 1.0, ce_weight: float = 0.0,
            temperature: float = 1.0, chunk_tokens: int = 1024,
            chunk_kernel: Optional[bool] = None) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """KD loss of one batch (``input_ids``, ``labels`` aligned with them, -100 = not supervised).

    The teacher runs in its own dtype under ``no_grad``. ``chunk_kernel``: each chunk's arithmetic in one Triton
    kernel (True) or torch ops (False); None: the kernel on the student's Triton path (``runtime.backend``). Metrics: ``kl`` (nats / supervised token, at
    ``temperature``), ``ce`` (the student's cross-entropy on the labels, nats / token), ``tokens`` (the
    number of supervised tokens, so that validation averages are exact token means)."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(-1)
    with torch.no_grad():
        t_hidden = final_hidden(teacher, input_ids)
        ht = t_hidden.reshape(-1, t_hidden.shape[-1]).index_select(0, rows)
    s_hidden = final_hidden(student, input_ids)
    hs = s_hidden.reshape(-1, s_hidden.shape[-1]).index_select(0, rows)
    ws, wt = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight
    if ws.shape[0] != wt.shape[0]:
        raise ConfigError(f"kd: student vocabulary {ws.shape[0]} differs from the teacher's {wt.shape[0]}")
    if chunk_kernel is None:
        backend = student.runtime.backend if isinstance(student, HybridForCausalLM) else "auto"
        chunk_kernel = use_triton(backend, hs)
    chunk = KDChunk(ht, wt.detach(), targets.index_select(0, rows), temperature, kl_weight, ce_weight,
                    triton=chunk_kernel)
    loss = ChunkedLinearHead.apply(hs, ws, chunk, int(chunk_tokens), torch.is_grad_enabled())
    n = max(rows.numel(), 1)
    return loss, {"kl": chunk.kl_sum / n, "ce": chunk.ce_sum / n, "tokens": rows.numel()}
