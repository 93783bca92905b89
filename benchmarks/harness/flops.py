"""Training FLOPs per token of the hybrid stacks and their peers, for MFU.

The count is of *model* FLOPs of one training step (forward + backward), per token, a multiply-add
counting 2. Work a kernel repeats (flash attention re-forming the scores in its backward, fla's
chunk kernels re-forming chunk states in theirs) is not counted, as is usual for MFU. Element-wise
work (norms, activations, gates, RoPE, softmax, the loss itself) is left out.

    flops/token = 6 * N_mm                                                   (dense)
                + sum over softmax-attention layers   3 * H * T * (d_qk + d_v)
                + sum over simple-GLA layers (Mamba2)  H * (6 C (K + V) + 12 K V)
                + sum over delta-rule layers (GDN/KDA) H * (18 C K + 12 C V + C^2 + 18 K V)

    MFU = flops/token * tokens/s / (peak FLOP/s per GPU * GPUs)

**Dense.** ``N_mm`` is every weight used in one multiply-add per token: each parameter with two or
more dimensions (linear weights, and the depthwise short-convolution kernels, ``width`` MACs per
channel per token) except the input embedding table (a lookup), plus the LM head ``vocab x hidden``
(counted once even when tied to the embedding). A weight does 2 FLOPs per token forward, and 4
backward (the input gradient and the weight gradient): 6 per token.

**Softmax attention** (MLA, Llama), causal, sequence length ``T``, ``H`` query heads (grouped KV
heads do not reduce this), head dims ``d_qk`` for scores and ``d_v`` for values. Without the mask a
query meets ``T`` keys: scores ``2 H d_qk T`` and the weighted sum ``2 H d_v T`` forward; the backward
has twice the matmuls (dQ and dK from dS; dV and dP): ``6 H T (d_qk + d_v)``. With the causal mask a
query meets ``(T + 1) / 2 ~ T / 2`` keys on average and flash attention skips the masked tiles, so
``6 H T (d_qk + d_v) / 2 = 3 H T (d_qk + d_v)`` (PaLM's ``12 L H Q T`` halved, ``d_qk = d_v = Q``).

**Chunked linear recurrences** (fla's chunk kernels, chunk ``C = 64``), per layer, per value head
(``H``: Mamba2 heads, or GDN / KDA value heads, which run with their own beta and gate), key dim
``K``, value dim ``V``, per token; the kernels compute the whole ``C x C`` intra-chunk tile and mask it
afterwards, so the tile is counted whole. The training count is 3 x forward, as for a matmul.

* Simple GLA (Mamba2's SSD, ``K = d_state``, ``V = head_dim``), forward: intra-chunk scores
  ``Q K^T`` ``2 C K``; intra-chunk output ``A V`` ``2 C V``; inter-chunk output ``Q S`` ``2 K V``; the chunk's
  state update ``S += K^T V`` ``2 K V``. Forward ``2 C (K + V) + 4 K V``; training ``6 C (K + V) + 12 K V``.
* Gated delta rule (GDN; KDA folds its per-channel decay into q / k element-wise: same matmuls),
  forward, WY form: ``beta K K^T`` ``2 C K``; the unit lower-triangular inverse ``(I + A)^-1``,
  ``C^3 / 3`` per chunk = ``C^2 / 3``; ``W = T beta K`` ``2 C K`` and ``U = T beta V`` ``2 C V``;
  ``V' = U - W S`` ``2 K V``; scores ``Q K^T`` ``2 C K``, ``A V'`` ``2 C V``, ``Q S`` ``2 K V``; state
  ``S = decay S + K^T V'`` ``2 K V``. Forward ``6 C K + 4 C V + C^2 / 3 + 6 K V``; training
  ``18 C K + 12 C V + C^2 + 18 K V``.

These recurrence terms are estimates of what the algorithm must do (the real kernels split tiles
further, e.g. KDA's 16-token sub-chunks). At the 300M shapes (T = 2048) they are 0.7-1.7 % of the
total, the three MLA layers of a 75 % hybrid add 2 %, and the dense term dominates (the tied LM head,
128256 x 1024, is 43 % of ``N_mm``): GDN-300M 1.866 GFLOP/token, Mamba2-300M 2.264, GDN-1B 7.27.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List

from torch import nn

H200_BF16_DENSE_TFLOPS = 989.5  # NVIDIA H200 SXM, bf16 tensor cores, dense (1979 is with 2:4 sparsity)
CHUNK_SIZE = 64  # fla's chunk length for chunk_gated_delta_rule, chunk_kda and chunk_simple_gla

ATTENTION, SIMPLE_GLA, DELTA_RULE = "attention", "simple_gla", "delta_rule"


@dataclass(frozen=True)
class MixerSpec:
    """One sequence-mixing layer as the FLOP count sees it."""
    kind: str    # ATTENTION | SIMPLE_GLA | DELTA_RULE
    heads: int   # query heads (attention) or value heads (recurrences)
    k_dim: int   # d_qk, or the recurrence key / state dim
    v_dim: int


def attention_flops(heads: int, qk_dim: int, v_dim: int, seq_len: int) -> float:
    """Causal softmax attention, training FLOPs per token: ``3 H T (d_qk + d_v)``."""
    return 3.0 * heads * seq_len * (qk_dim + v_dim)


def simple_gla_flops(heads: int, k_dim: int, v_dim: int, chunk: int = CHUNK_SIZE) -> float:
    """Chunked scalar-decay linear attention (Mamba2 SSD), training FLOPs per token:
    ``H (6 C (K + V) + 12 K V)``."""
    return heads * (6.0 * chunk * (k_dim + v_dim) + 12.0 * k_dim * v_dim)


def delta_rule_flops(heads: int, k_dim: int, v_dim: int, chunk: int = CHUNK_SIZE) -> float:
    """Chunked gated delta rule (GDN, KDA) in WY form, training FLOPs per token:
    ``H (18 C K + 12 C V + C^2 + 18 K V)``."""
    return heads * (18.0 * chunk * k_dim + 12.0 * chunk * v_dim + chunk * chunk + 18.0 * k_dim * v_dim)


def mixer_flops(spec: MixerSpec, seq_len: int, chunk: int = CHUNK_SIZE) -> float:
    if spec.kind == ATTENTION:
        return attention_flops(spec.heads, spec.k_dim, spec.v_dim, seq_len)
    if spec.kind == SIMPLE_GLA:
        return simple_gla_flops(spec.heads, spec.k_dim, spec.v_dim, chunk)
    if spec.kind == DELTA_RULE:
        return delta_rule_flops(spec.heads, spec.k_dim, spec.v_dim, chunk)
    raise ValueError(f"unknown mixer kind {spec.kind!r}")


def matmul_params(model: nn.Module) -> int:
    """``N_mm``: parameters with >= 2 dims except the input embedding, plus the LM head when it is tied to
    the embedding (then it is the same tensor, skipped above). Works on meta-device models."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    seen, total = {id(emb)}, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() >= 2:
            total += p.numel()
    if out is not None and out.weight is emb:  # tied: the LM head is a matmul even though its weight is not new
        total += emb.numel()
    return total


def train_flops_per_token(n_matmul: int, mixers: Iterable[MixerSpec], seq_len: int,
                          chunk: int = CHUNK_SIZE) -> Dict[str, float]:
    """``{"dense", "attention", "recurrence", "total"}`` training FLOPs per token (module docstring)."""
    dense = 6.0 * n_matmul
    attn = rec = 0.0
    for m in mixers:
        f = mixer_flops(m, seq_len, chunk)
        if m.kind == ATTENTION:
            attn += f
        else:
            rec += f
    return {"dense": dense, "attention": attn, "recurrence": rec, "total": dense + attn + rec}


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float, num_gpus: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all GPUs."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * num_gpus)


# ------------------------------------------------------------------ mixer lists of the models we time

def hybrid_mixers(config) -> List[MixerSpec]:
    """The sequence mixers of a :class:`~hybridlm.model.HybridConfig`, in layer order."""
    out = []
    for kind in config.layer_plan:
        if kind == "mla":
            a = config.mixer_args("mla")
            out.append(MixerSpec(ATTENTION, a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim))
        elif kind in ("gdn", "kda"):
            a = config.mixer_args(kind)
            out.append(MixerSpec(DELTA_RULE, a.num_v_heads, a.head_dim, a.head_v_dim))
        elif kind == "mamba2":
            a = config.mixer_args("mamba2")
            d_inner = a.d_inner or a.expand * config.hidden_size
            out.append(MixerSpec(SIMPLE_GLA, d_inner // a.head_dim, a.d_state, a.head_dim))
        elif kind != "mlp":
            raise ValueError(f"unknown sublayer kind {kind!r}")
    return out


def fla_delta_rule_mixers(config) -> List[MixerSpec]:
    """fla's GatedDeltaNetConfig / KDAConfig: ``num_hidden_layers`` delta-rule layers."""
    heads = config.num_v_heads or config.num_heads
    return [MixerSpec(DELTA_RULE, heads, config.head_dim, int(config.head_dim * config.expand_v))
            for _ in range(config.num_hidden_layers)]


def llama_mixers(config) -> List[MixerSpec]:
    """transformers' LlamaConfig: ``num_hidden_layers`` causal attention layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [MixerSpec(ATTENTION, config.num_attention_heads, head_dim, head_dim)
            for _ in range(config.num_hidden_layers)]


def describe(mixers: Iterable[MixerSpec]) -> List[Dict[str, Any]]:
    """Distinct mixer specs with their layer counts (for the JSON report)."""
    counts: Dict[MixerSpec, int] = {}
    for m in mixers:
        counts[m] = counts.get(m, 0) + 1
    return [{**asdict(m), "layers": n} for m, n in counts.items()]


FORMULA = ("flops/token = 6*N_mm + sum_attn 3*H*T*(d_qk+d_v) + sum_mamba2 H*(6*C*(K+V) + 12*K*V) "
           "+ sum_gdn/kda H*(18*C*K + 12*C*V + C^2 + 18*K*V); N_mm = params with >=2 dims except the input "
           "embedding, plus the LM head (vocab*hidden) once; T = sequence length, C = 64 (fla chunk); "
           "MFU = flops/token * tokens/s / (peak * GPUs). See benchmarks/harness/flops.py.")
