"""SVD initialisation of an MLA sublayer from a Llama attention layer (fp32).

Per head, the teacher's d_h query / key dims split into ``nope`` dims (no rotation) and ``rope`` dims.
* Queries: W_q (rows reordered per head to [nope | rope]) = U S V^T; q_a = S_r V_r^T, q_b = U_r.
* Keys and values: GQA heads repeated to the n_h query heads, then one joint SVD of the stacked per-head
  [W_k nope rows; W_v]; kv_a's latent rows = S_r V_r^T, kv_b = U_r (per head: K nope rows, then V rows).
* The decoupled RoPE key is one shared head: the mean of the teacher's kv heads' rope rows (exact when
  the teacher has one kv head).
* o_proj = W_o.
* A teacher whose RoPE scales cos and sin by ``attention_scaling`` (yarn, longrope) scales every score by its
  square; that factor goes into W_q.
Which dims are ``rope`` is the ``rope_init`` of :func:`upcycle.student.mla_args`. With no rope dims
(positions removed) and full ranks the layer reproduces the teacher's attention exactly.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from hybridlm.config.errors import ConfigError
from upcycle.student import teacher_rope
from upcycle.teacher_attention import attention_weights


def rope_rows(d_h: int, qk_rope_head_dim: int, rope_init: str) -> List[int]:
    """Teacher head-dim rows that become the student's rope dims, in the student's rotate-half order."""
    if rope_init == "frequency_matched":  # pairs (i, i + d_h/2) for the qk_rope_head_dim/2 highest frequencies
        half = qk_rope_head_dim // 2
        return list(range(half)) + list(range(d_h // 2, d_h // 2 + half))
    return list(range(qk_rope_head_dim))


def _split_rows(d_h: int, qk_rope_head_dim: int, rope_init: str):
    rope = rope_rows(d_h, qk_rope_head_dim, rope_init)
    nope = [i for i in range(d_h) if i not in set(rope)]
    return nope, rope


def energy_rank(singular_values: torch.Tensor, delta: float, multiple: int = 8) -> int:
    """Smallest rank whose cumulative sigma^2 energy reaches ``delta``, rounded up to ``multiple``."""
    if not 0.0 < delta <= 1.0:
        raise ConfigError(f"energy: {delta} must be in (0, 1]")
    e = singular_values.double().pow(2)
    frac = e.cumsum(0) / e.sum()
    r = int(torch.searchsorted(frac, torch.tensor(delta, dtype=frac.dtype) - 1e-12).item()) + 1
    r = -(-r // multiple) * multiple
    return min(r, singular_values.numel())


def _factor(matrix: torch.Tensor, rank: int, field: str):
    """``matrix ~= up @ down`` with ``down = S_r V_r^T`` ([rank, in]) and ``up = U_r`` ([out, rank]),
    plus the fraction of sigma^2 energy the rank keeps."""
    bound = min(matrix.shape)
    if rank > bound:
        raise ConfigError(f"{field}: {rank} exceeds what the {tuple(matrix.shape)} matrix allows (at most {bound})")
    U, S, Vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    energy = S.pow(2)
    return U[:, :rank], S[:rank, None] * Vh[:rank], float(energy[:rank].sum() / energy.sum())


def mla_matrices(attn, n_h: int, n_kv: int, d_h: int, qk_rope_head_dim: int, rope_init: str):
    """The three matrices the SVDs factor: W_q (reordered), stacked [K nope; V] per query head, shared K rope."""
    w = attention_weights(attn)
    d = w["q"].shape[1]
    nope, rope = _split_rows(d_h, qk_rope_head_dim, rope_init)
    order = nope + rope
    wq = w["q"].view(n_h, d_h, d)[:, order].reshape(n_h * d_h, d)
    wk = w["k"].view(n_kv, d_h, d)
    wv = w["v"].view(n_kv, d_h, d)
    group = n_h // n_kv
    kv = torch.cat([wk[:, nope], wv], dim=1).repeat_interleave(group, dim=0).reshape(n_h * (len(nope) + d_h), d)
    k_rope = wk[:, rope].mean(0) if rope else wk.new_zeros(0, d)
    return wq, kv, k_rope, w["o"]


@torch.no_grad()
def init_mla_from_attention(mla, attn, *, n_kv: int, rope_init: str = "frequency_matched") -> Dict[str, float]:
    """Fill ``mla`` (a :class:`MultiHeadLatentAttention` built by :func:`upcycle.student.student_config`)
    from the teacher attention ``attn``. Returns the fraction of singular-value energy kept (q, kv)."""
    n_h, d_h = mla.num_heads, mla.nope + mla.rope
    if mla.v_dim != d_h:
        raise ConfigError(f"mla.v_head_dim: {mla.v_dim} must equal the teacher head dim {d_h} for the SVD init")
    wq, kv, k_rope, wo = mla_matrices(attn, n_h, n_kv, d_h, mla.rope, rope_init)
    scaling = teacher_attention_scaling(attn)
    if scaling != 1.0:  # the teacher scales cos and sin, so every score by scaling^2: folded into W_q
        wq = wq * scaling ** 2
    kept = {}
    if mla.q_lora_rank:
        up, down, kept["q_energy"] = _factor(wq, mla.q_lora_rank, "q_lora_rank")
        mla.q_a_proj.weight.copy_(down)
        mla.q_b_proj.weight.copy_(up)
    else:
        mla.q_proj.weight.copy_(wq)
        kept["q_energy"] = 1.0
    up, down, kept["kv_energy"] = _factor(kv, mla.kv_lora_rank, "kv_lora_rank")
    mla.kv_a_proj.weight.copy_(torch.cat([down.to(k_rope.dtype), k_rope], dim=0))
    mla.kv_b_proj.weight.copy_(up)
    mla.o_proj.weight.copy_(wo)
    return kept


def teacher_attention_scaling(attn) -> float:
    """The factor transformers multiplies the teacher's RoPE cos and sin by (1.0 unless yarn / longrope)."""
    cfg = getattr(attn, "config", None)
    if cfg is None:
        return 1.0
    return teacher_rope(cfg)["attention_scaling"]


def energy_ranks(attns: Sequence, n_h: int, n_kv: int, d_h: int, qk_rope_head_dim: int, delta: float,
                 rope_init: str = "frequency_matched") -> Dict[str, int]:
    """``q_lora_rank`` / ``kv_lora_rank`` reaching energy ``delta`` in every given layer (one MLA shape serves all
    layers)."""
    q_lora_rank, kv_lora_rank = 8, 8
    for attn in attns:
        wq, m, _, _ = mla_matrices(attn, n_h, n_kv, d_h, qk_rope_head_dim, rope_init)
        q_lora_rank = max(q_lora_rank, energy_rank(torch.linalg.svdvals(wq.double()), delta))
        kv_lora_rank = max(kv_lora_rank, energy_rank(torch.linalg.svdvals(m.double()), delta))
    return {"q_lora_rank": q_lora_rank, "kv_lora_rank": kv_lora_rank}
