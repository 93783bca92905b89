"""Forward FLOPs per token of the token-mixing algorithms, beyond the weight multiplies (a multiply-add counts 2).

The mixers' registry entries (:class:`hybridlm.model.registry.MixerCosts`) are built on these; ``upcycle plan``
and ``benchmarks/harness/flops.py`` read the entries. Element-wise work (norms, activations, gates, RoPE, softmax)
is left out. Training costs 3x the forward (the backward has twice the matmuls), as for a weight.

**Causal softmax attention**, context ``T``, ``H`` query heads (grouped KV heads do not reduce this), head dims
``d_qk`` for scores and ``d_v`` for values. Without the mask a query meets ``T`` keys: scores ``2 H d_qk T`` and
the weighted sum ``2 H d_v T``. With the causal mask a query meets ``(T + 1) / 2 ~ T / 2`` keys on average and
flash attention skips the masked tiles: ``H T (d_qk + d_v)`` forward, ``3 H T (d_qk + d_v)`` trained (PaLM's
``12 L H Q T`` halved, ``d_qk = d_v = Q``).

**Chunked linear recurrences** (fla's chunk kernels, chunk ``C = 64``), per value head (``H``: Mamba2 heads, or
GDN / KDA value heads, which run with their own beta and gate), key dim ``K``, value dim ``V``; the kernels compute
the whole ``C x C`` intra-chunk tile and mask it afterwards, so the tile is counted whole.

* Simple GLA (Mamba2's SSD, ``K = d_state``, ``V = head_dim``): intra-chunk scores ``Q K^T`` ``2 C K``;
  intra-chunk output ``A V`` ``2 C V``; inter-chunk output ``Q S`` ``2 K V``; the chunk's state update
  ``S += K^T V`` ``2 K V``. Forward ``2 C (K + V) + 4 K V``.
* Gated delta rule (GDN; KDA folds its per-channel decay into q / k element-wise: same matmuls), WY form:
  ``beta K K^T`` ``2 C K``; the unit lower-triangular inverse ``(I + A)^-1``, ``C^3 / 3`` per chunk =
  ``C^2 / 3``; ``W = T beta K`` ``2 C K`` and ``U = T beta V`` ``2 C V``; ``V' = U - W S`` ``2 K V``; scores
  ``Q K^T`` ``2 C K``, ``A V'`` ``2 C V``, ``Q S`` ``2 K V``; state ``S = decay S + K^T V'`` ``2 K V``. Forward
  ``6 C K + 4 C V + C^2 / 3 + 6 K V``.

The recurrence terms are estimates of what the algorithm must do (the real kernels split tiles further, e.g.
KDA's 16-token sub-chunks).
"""
from __future__ import annotations

CHUNK_SIZE = 64  # fla's chunk length for chunk_gated_delta_rule, chunk_kda and chunk_simple_gla


def causal_attention_flops(heads: int, qk_dim: int, v_dim: int, seq_len: int) -> float:
    """Causal softmax attention over a ``seq_len`` context: ``H T (d_qk + d_v)``."""
    return float(heads * seq_len * (qk_dim + v_dim))


def simple_gla_flops(heads: int, k_dim: int, v_dim: int, chunk: int = CHUNK_SIZE) -> float:
    """Chunked scalar-decay linear attention (Mamba2's SSD): ``H (2 C (K + V) + 4 K V)``."""
    return heads * (2.0 * chunk * (k_dim + v_dim) + 4.0 * k_dim * v_dim)


def delta_rule_flops(heads: int, k_dim: int, v_dim: int, chunk: int = CHUNK_SIZE) -> float:
    """Chunked gated delta rule (GDN, KDA) in WY form: ``H (6 C K + 4 C V + C^2 / 3 + 6 K V)``."""
    return heads * (6.0 * chunk * k_dim + 4.0 * chunk * v_dim + chunk * chunk / 3.0 + 6.0 * k_dim * v_dim)
