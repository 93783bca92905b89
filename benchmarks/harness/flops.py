"""Training FLOPs per token of the hybrid stacks and their peers, for MFU.

The count is of *model* FLOPs of one training step (forward + backward), per token, a multiply-add
counting 2. Work a kernel repeats (flash attention re-forming the scores in its backward, fla's
chunk kernels re-forming chunk states in theirs) is not counted, as is usual for MFU. Element-wise
work (norms, activations, gates, RoPE, softmax, the loss itself) is left out.

    flops/token = 6 * N_mm + sum over sequence-mixing layers 3 * (forward FLOPs per token beyond the weights)

    MFU = flops/token * tokens/s / (peak FLOP/s per GPU * GPUs)

**Dense.** ``N_mm`` is every weight used in one multiply-add per token: each parameter with two or
more dimensions (linear weights, and the depthwise short-convolution kernels, ``width`` MACs per
channel per token) except the input embedding table (a lookup), plus the LM head ``vocab x hidden``
(counted once even when tied to the embedding). A weight does 2 FLOPs per token forward, and 4
backward (the input gradient and the weight gradient): 6 per token.

**Sequence mixing.** A hybrid layer's forward FLOPs beyond its weights are its mixer's registry entry
(:class:`hybridlm.model.registry.MixerCosts` ``flops``, at the sequence length ``T``); the formulas and their
derivations are in ``hybridlm/model/layers/mixing_flops.py``: causal softmax attention (MLA, and the Llama
peer) ``H T (d_qk + d_v)``, Mamba2's chunked SSD ``H (2 C (K + V) + 4 K V)``, the gated delta rule (GDN,
KDA) ``H (6 C K + 4 C V + C^2 / 3 + 6 K V)``, with ``C = 64``. Training costs 3x the forward, as for a
matmul. Attention (the mixers with a per-token cache, whose cost grows with ``T``) and the recurrences
are reported apart.

At the 300M shapes (T = 2048) the recurrence terms are 0.7-1.7 % of the total, the three MLA layers of
a 75 % hybrid add 2 %, and the dense term dominates (the tied LM head, 128256 x 1024, is 43 % of
``N_mm``): GDN-300M 1.866 GFLOP/token, Mamba2-300M 2.264, GDN-1B 7.27.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List

from torch import nn

from hybridlm.model.layers.mixing_flops import causal_attention_flops
from hybridlm.model.registry import LATENT, cache_of, costs_of, is_mixer, mixer_spec

H200_BF16_DENSE_TFLOPS = 989.5  # NVIDIA H200 SXM, bf16 tensor cores, dense (1979 is with 2:4 sparsity)
LLAMA_ATTENTION = "llama"  # the Llama peer's softmax attention (not a registered mixer)


@dataclass(frozen=True)
class MixerFlops:
    """One sequence-mixing layer as the FLOP count sees it, at one sequence length."""
    kind: str         # its registered mixer kind (or LLAMA_ATTENTION)
    attention: bool   # a per-token cache: its cost grows with the sequence
    forward: float    # forward FLOPs per token beyond the weight multiplies


def registered_mixer(kind: str, args, seq_len: int) -> MixerFlops:
    """A layer of the registered mixer ``kind`` with finalized settings ``args`` (its registry costs)."""
    return MixerFlops(kind, cache_of(kind) == LATENT, float(costs_of(kind).flops(args, seq_len)))


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


def train_flops_per_token(n_matmul: int, mixers: Iterable[MixerFlops]) -> Dict[str, float]:
    """``{"dense", "attention", "recurrence", "total"}`` training FLOPs per token (module docstring)."""
    dense = 6.0 * n_matmul
    attn = rec = 0.0
    for m in mixers:
        if m.attention:
            attn += 3.0 * m.forward
        else:
            rec += 3.0 * m.forward
    return {"dense": dense, "attention": attn, "recurrence": rec, "total": dense + attn + rec}


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float, num_gpus: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all GPUs."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * num_gpus)


# ------------------------------------------------------------------ mixer lists of the models we time

def hybrid_mixers(config, seq_len: int) -> List[MixerFlops]:
    """The sequence mixers of a :class:`~hybridlm.model.HybridConfig`, in layer order."""
    return [registered_mixer(kind, config.mixer_args(kind), seq_len) for kind in config.layer_plan if is_mixer(kind)]


def fla_delta_rule_mixers(config, kind: str, seq_len: int) -> List[MixerFlops]:
    """fla's GatedDeltaNetConfig / KDAConfig: ``num_hidden_layers`` layers of our mixer ``kind`` (``gdn`` /
    ``kda``) at its shapes."""
    args = mixer_spec(kind).args(num_heads=config.num_heads, head_dim=config.head_dim,
                                 num_v_heads=config.num_v_heads or config.num_heads,
                                 head_v_dim=int(config.head_dim * config.expand_v))
    args.finalize(config.hidden_size, kind)
    return [registered_mixer(kind, args, seq_len)] * config.num_hidden_layers


def llama_mixers(config, seq_len: int) -> List[MixerFlops]:
    """transformers' LlamaConfig: ``num_hidden_layers`` causal attention layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    flops = causal_attention_flops(config.num_attention_heads, head_dim, head_dim, seq_len)
    return [MixerFlops(LLAMA_ATTENTION, True, flops)] * config.num_hidden_layers


def describe(mixers: Iterable[MixerFlops]) -> List[Dict[str, Any]]:
    """Distinct mixers with their layer counts (for the JSON report)."""
    counts: Dict[MixerFlops, int] = {}
    for m in mixers:
        counts[m] = counts.get(m, 0) + 1
    return [{**asdict(m), "layers": n} for m, n in counts.items()]


FORMULA = ("flops/token = 6*N_mm + sum over mixing layers 3*(forward FLOPs beyond the weights, the mixer's registry "
           "costs: attention H*T*(d_qk+d_v), Mamba2 H*(2*C*(K+V) + 4*K*V), GDN/KDA H*(6*C*K + 4*C*V + C^2/3 + "
           "6*K*V)); N_mm = params with >=2 dims except the input embedding, plus the LM head (vocab*hidden) once; "
           "T = sequence length, C = 64 (fla chunk); MFU = flops/token * tokens/s / (peak * GPUs). See "
           "benchmarks/harness/flops.py and hybridlm/model/layers/mixing_flops.py.")
