"""Pure-torch chunked linear recurrences: the CPU path of every linear mixer.

One function covers the three mixers, which differ only in the gate shape and the delta rule:

* Mamba2 SSD / simple GLA: scalar gate per head, no delta rule
  ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``
* Gated DeltaNet: scalar gate per head, delta rule
  ``S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T``
* Kimi Delta Attention: one gate per key channel, delta rule
  ``S_t = diag(exp(g_t)) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T``

and every one reads out ``o_t = scale * S_t^T q_t``. Layout follows flash-linear-attention:
q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H]`` or ``[B, T, H, K]`` (log-decay, <= 0),
beta ``[B, T, H]``, state ``[B, H, K, V]``.

Within a chunk of C tokens the delta rule's corrections solve a unit lower-triangular system (the
WY / UT form); across chunks the state is carried sequentially. All decays are formed as
``exp(G_t - G_i)`` with ``i <= t`` so nothing overflows, whatever the gate magnitudes.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps), the normalisation fla applies to q and k in-kernel."""
    return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


def chunk_gated_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the gated (delta-rule if ``beta`` is given) linear recurrence chunk by chunk.

    Computation is in fp32 whatever the input dtype; the output has v's dtype.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ValueError(f"chunk_gated_recurrence: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    vector_gate = g.dim() == 4
    if g.shape[:3] != (B, T, H) or (vector_gate and g.shape[-1] != K):
        raise ValueError(f"chunk_gated_recurrence: gate shape {tuple(g.shape)} fits neither [B,T,H] nor [B,T,H,K]")
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    # [B, H, T, D] in fp32, padded to a whole number of chunks (padding: zero k/v/q, zero log-gate).
    q, k, v, g = (x.transpose(1, 2).float() for x in (q, k, v, g))
    beta = beta.transpose(1, 2).float() if beta is not None else None
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad)) if vector_gate else F.pad(g, (0, pad))
        beta = F.pad(beta, (0, pad)) if beta is not None else None
    n_chunks = (T + pad) // C
    state = (initial_state.float() if initial_state is not None
             else q.new_zeros(B, H, K, V))
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    outputs = []
    for c in range(n_chunks):
        sl = slice(c * C, (c + 1) * C)
        qc, kc, vc = q[:, :, sl], k[:, :, sl], v[:, :, sl]
        G = g[:, :, sl].cumsum(2)  # cumulative log-decay inside the chunk, G_t = sum_{s<=t} g_s
        if vector_gate:
            # pairwise decay exp(G_t - G_i) per key channel, [B,H,C,C,K]; masked before exp so it stays <= 1
            diff = (G.unsqueeze(3) - G.unsqueeze(2)).masked_fill(~causal[:, :, None], float("-inf")).exp()
            qk = torch.einsum("bhtd,bhid,bhtid->bhti", qc, kc, diff)
            q_decayed = qc * G.exp()
            k_decayed = kc * G.exp()
            k_to_end = kc * (G[:, :, -1:] - G).exp()
            end_decay = G[:, :, -1].exp().unsqueeze(-1)  # [B,H,K,1]
        else:
            diff = (G.unsqueeze(3) - G.unsqueeze(2)).masked_fill(~causal, float("-inf")).exp()
            qk = (qc @ kc.transpose(-1, -2)) * diff
            q_decayed = qc * G.exp().unsqueeze(-1)
            k_decayed = kc * G.exp().unsqueeze(-1)
            k_to_end = kc * (G[:, :, -1:] - G).exp().unsqueeze(-1)
            end_decay = G[:, :, -1].exp()[..., None, None]
        if beta is not None:
            bc = beta[:, :, sl].unsqueeze(-1)
            # u = (I + A)^-1 beta (v - K_decayed S0), A[t,i] = beta_t <k_t, k_i> exp(G_t - G_i), i < t
            kk = (torch.einsum("bhtd,bhid,bhtid->bhti", kc, kc, diff) if vector_gate
                  else (kc @ kc.transpose(-1, -2)) * diff)
            A = (bc * kk).masked_fill(~strict, 0.0)
            eye = torch.eye(C, device=q.device, dtype=A.dtype)
            rhs = bc * (vc - k_decayed @ state)
            u = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
        else:
            u = vc
        outputs.append(scale * (q_decayed @ state + qk @ u))
        state = end_decay * state + k_to_end.transpose(-1, -2) @ u
    o = torch.cat(outputs, dim=2)[:, :, :T].transpose(1, 2).to(out_dtype)
    return o, (state if output_final_state else None)


def recurrent_gated_step(q, k, v, g, beta, state, scale):
    """One token of the same recurrence (decoding): q, k ``[B,H,K]``, v ``[B,H,V]``, g ``[B,H]`` or
    ``[B,H,K]``, beta ``[B,H]`` or None, state ``[B,H,K,V]`` (its dtype is the compute dtype). Returns (o ``[B,H,V]``, new state)."""
    dt = state.dtype
    decay = g.to(dt).exp()
    decay = decay.unsqueeze(-1) if decay.dim() == 3 else decay[..., None, None]
    state = state * decay
    k, q, v = k.to(dt), q.to(dt), v.to(dt)
    if beta is not None:
        v = beta.to(dt).unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k.unsqueeze(-1) * v.unsqueeze(-2)
    return scale * torch.einsum("bhk,bhkv->bhv", q, state), state


def gated_recurrence_with_state(q, k, v, g, beta, scale, initial_state=None, chunk_size: int = 64):
    """Cached inference: continue from ``initial_state`` (None: zeros) and return ``(o, final state)``.

    One token after a state is a decoding step (:func:`recurrent_gated_step`, fp32 state); anything longer
    (a prompt, or several tokens at once) goes through the chunked form."""
    if initial_state is not None and q.shape[1] == 1:
        o, state = recurrent_gated_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], None if beta is None else beta[:, 0],
                                        initial_state.float(), scale)
        return o.unsqueeze(1).to(v.dtype), state
    return chunk_gated_recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=True, chunk_size=chunk_size)
