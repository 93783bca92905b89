"""transformers' Mamba2 peer with a chunked SSD kernel in place of its reference torch SSD.

Without ``mamba_ssm`` transformers' ``Mamba2Mixer`` runs ``mamba2_chunk_scan``, a reference SSD whose
transient products make a 300M model take ~5 s a step on an H200 at 8 x 2048 tokens (25 minutes for a
300-step peer run). :func:`chunk_scan_via` writes the same function over a chunked
simple-GLA operator (the SSD with a scalar decay per head is simple gated linear attention with q = C, k = B,
v = dt * x, log-decay A * dt, scale 1): fla's ``chunk_simple_gla`` on CUDA, the project's torch recurrence
on a CPU. Everything else of the peer (its parameters and their initialisation, in_proj, conv, gated norm,
out_proj, the loss) stays transformers' own; :func:`compare_on_batch` measures, on the run's own batch,
that the peer computes the same loss and gradients either way before it is trained with the kernel.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.nn.functional as F

from hybridlm.ops.chunked_recurrence import chunk_gated_recurrence

# op(q, k, v, g, initial_state) -> (y, final_state): the SSD as gated linear attention, [B, T, H, *]
GlaOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
                 tuple]


def fla_gla_op(q, k, v, g, initial_state):
    from fla.ops.simple_gla import chunk_simple_gla
    return chunk_simple_gla(q=q, k=k, v=v, g=g, scale=1.0, initial_state=initial_state, output_final_state=True)


def torch_gla_op(q, k, v, g, initial_state):
    return chunk_gated_recurrence(q, k, v, g, beta=None, scale=1.0, initial_state=initial_state,
                                  output_final_state=True)


def chunk_scan_via(op: GlaOp) -> Callable:
    """A function with the signature and result of transformers' ``mamba2_chunk_scan`` that runs ``op``."""

    def chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                   dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False, **_):
        heads = hidden_states.shape[2]
        dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        dt = F.softplus(dt) if dt_softplus else dt
        dt = dt.clamp(dt_limit[0], dt_limit[1])                                  # [B, T, H]
        x = hidden_states.float()
        per_group = heads // B.shape[2]  # each group serves consecutive heads, as in transformers
        q = C.repeat_interleave(per_group, dim=2)
        k = B.repeat_interleave(per_group, dim=2)
        v = (x * dt[..., None]).to(q.dtype)
        # the GLA state is [B, H, K = state, V = head_dim], transformers' [B, H, head_dim, state]
        state = initial_states.transpose(-1, -2).float().contiguous() if initial_states is not None else None
        y, final = op(q, k, v, A.float() * dt, state)
        y = y.float()
        if D is not None:
            y = y + D.float()[:, None] * x
        return (y, final.transpose(-1, -2)) if return_final_states else y

    return chunk_scan


@contextlib.contextmanager
def patched_chunk_scan(op: GlaOp) -> Iterator[None]:
    """transformers' Mamba2 mixers run ``op`` for their SSD inside the block (the module global they call)."""
    from transformers.models.mamba2 import modeling_mamba2
    original = modeling_mamba2.mamba2_chunk_scan
    install(op)
    try:
        yield
    finally:
        modeling_mamba2.mamba2_chunk_scan = original


def install(op: GlaOp) -> None:
    """For the rest of the process (a training run): transformers' Mamba2 uses ``op``."""
    from transformers.models.mamba2 import modeling_mamba2
    modeling_mamba2.mamba2_chunk_scan = chunk_scan_via(op)


def loss_and_grads(model, ids: torch.Tensor, autocast: bool):
    """The loss of ``model`` on ``ids`` (its own labels) and every parameter's gradient, in fp32 copies."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def compare_on_batch(model, ids: torch.Tensor, op: GlaOp, autocast: bool) -> Dict[str, float]:
    """Loss and gradients of ``model`` on ``ids`` with its own SSD and with ``op``: the loss difference, and
    the worst cosine / relative norm difference over the parameter tensors' gradients."""
    ref_loss, ref = loss_and_grads(model, ids, autocast)
    with patched_chunk_scan(op):
        loss, new = loss_and_grads(model, ids, autocast)
    names = set(ref) | set(new)  # a tensor with a gradient on one side only is a zero gradient on the other
    zero = {n: torch.zeros_like(ref.get(n, new.get(n))) for n in names}
    ref, new = {n: ref.get(n, zero[n]) for n in names}, {n: new.get(n, zero[n]) for n in names}
    cos = min(F.cosine_similarity(ref[n].flatten(), new[n].flatten(), dim=0).item() for n in names)
    rel = max(((ref[n] - new[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() for n in names)
    return {"reference_loss": ref_loss, "kernel_loss": loss, "loss_diff": abs(loss - ref_loss),
            "min_grad_cosine": cos, "max_grad_rel_diff": rel, "tensors": len(names)}
