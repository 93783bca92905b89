"""SVD MLA init from a Llama attention: exact at full rank without positions, error falls with rank,
our frequency-matched RoPE choice preserves position information better than the published one, and a
teacher with scaled RoPE (llama3, linear, dynamic, yarn) keeps its actual frequencies."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import rel_err
from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridForCausalLM
from upcycle.init_mla import energy_rank, energy_ranks, init_mla_from_attention
from upcycle.student import kept_inv_freq, llama_shapes, rope_mismatch, student_config

# head dim 16 at base 1e4: pair wavelengths 6.3, 20, 63, 199, ... tokens. With original_max_position_embeddings
# 64, llama3 keeps pair 0, blends pairs 1 and 2 and divides pairs 3-7 by the factor.
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
}


def teacher(n_kv=2, seed=0, rope_scaling=None):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=n_kv, head_dim=16, vocab_size=64, rope_theta=10000.0,
                      max_position_embeddings=512, rope_scaling=rope_scaling, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def teacher_attention(model, x, positions=True):
    T = x.shape[1]
    pos = torch.arange(T)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    if not positions:  # identity rotation: the attention with positions removed
        cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    out = model.model.layers[0].self_attn(x, position_embeddings=(cos, sin), attention_mask=None)
    return out[0]


def student_attention(model, q_lora_rank, kv_lora_rank, qk_rope_head_dim, rope_init="frequency_matched"):
    cfg = student_config(model.config, ["mla", "mla"], q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                         qk_rope_head_dim=qk_rope_head_dim, rope_init=rope_init)
    mla = HybridForCausalLM(cfg).model.layers[0].mixer
    init_mla_from_attention(mla, model.model.layers[0].self_attn, n_kv=model.config.num_key_value_heads,
                            rope_init=rope_init)
    return mla


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_full_rank_without_positions_is_exact(n_kv):
    model = teacher(n_kv)
    x = torch.randn(2, 23, 64)
    mla = student_attention(model, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=0)
    assert rel_err(mla(x), teacher_attention(model, x, positions=False)) < 1e-5


def test_error_falls_monotonically_with_rank():
    model = teacher(2)
    x = torch.randn(2, 23, 64)
    ref = teacher_attention(model, x, positions=False)
    errors = [rel_err(student_attention(model, q_lora_rank=r, kv_lora_rank=r, qk_rope_head_dim=0)(x), ref)
              for r in (8, 16, 32, 48, 64)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5 < errors[0]


def test_frequency_matched_rope_is_exact_for_one_kv_head_when_all_dims_rotate():
    """With one kv head the shared RoPE key loses nothing, so rotating all head dims with the teacher's
    pairing and frequencies reproduces the attention *with positions* at full rank."""
    model = teacher(1)
    x = torch.randn(2, 40, 64)
    ref = teacher_attention(model, x, positions=True)
    assert rel_err(student_attention(model, 64, 64, qk_rope_head_dim=16)(x), ref) < 1e-5


def test_frequency_matched_rope_keeps_positions_better_than_published():
    """Half the dims rotating: ours keeps the high-frequency pairs exactly (the low ones stop rotating);
    the published re-pairing scrambles them. Measured here: ours 1.0e-3, published 1.6e-2."""
    model = teacher(1)
    x = torch.randn(2, 40, 64)
    ref = teacher_attention(model, x, positions=True)
    ours = rel_err(student_attention(model, 64, 64, qk_rope_head_dim=8)(x), ref)
    published = rel_err(student_attention(model, 64, 64, qk_rope_head_dim=8, rope_init="published")(x), ref)
    assert ours * 5 < published, (ours, published)


def test_frequency_matched_beats_published_with_gqa():
    model = teacher(2)
    x = torch.randn(2, 40, 64)
    ref = teacher_attention(model, x, positions=True)
    ours = rel_err(student_attention(model, 64, 64, qk_rope_head_dim=8)(x), ref)
    published = rel_err(student_attention(model, 64, 64, qk_rope_head_dim=8, rope_init="published")(x), ref)
    assert ours < published, (ours, published)


def test_rank_larger_than_the_matrix_is_a_clear_error():
    model = teacher(2)
    with pytest.raises(ConfigError, match="kv_lora_rank: 72 exceeds what the"):
        student_attention(model, q_lora_rank=64, kv_lora_rank=72, qk_rope_head_dim=0)


def test_energy_rank_rounds_up_to_eight():
    s = torch.tensor([10.0, 5.0, 1.0, 0.5] + [0.01] * 60)
    assert energy_rank(s, 0.5) == 8 and energy_rank(s, 1.0) == 64
    # a teacher whose q projections have rank 12 (the kv side stays full rank): all the energy is in 12
    # directions, so q needs 12 -> 16 (rounded up to 8), and kv its full rank 48: per kv head 8 non-RoPE key
    # rows + 16 value rows, 2 kv heads (the query heads of a group share them)
    model = teacher(2)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.q_proj.weight
            w.copy_(torch.randn(w.shape[0], 12) @ torch.randn(12, w.shape[1]))
    attns = [layer.self_attn for layer in model.model.layers]
    assert energy_ranks(attns, 4, 2, 16, 8, 1.0) == {"q_lora_rank": 16, "kv_lora_rank": 48}
    # at 90 % of the energy each rank is what the singular values say, the larger over the two layers
    ranks = energy_ranks(attns, 4, 2, 16, 8, 0.9)
    assert ranks["q_lora_rank"] <= 16 and ranks["kv_lora_rank"] < 48


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_teacher_frequencies_are_transformers_own(kind):
    """The frequencies the student takes are the ones ROPE_INIT_FUNCTIONS gives the teacher, pair for pair."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    model = teacher(1, rope_scaling=SCALINGS[kind])
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](model.config, None)
    s = llama_shapes(model.config)
    assert s["rope"]["rope_type"] == kind and s["rope"]["attention_scaling"] == pytest.approx(scaling)
    assert torch.equal(torch.tensor(s["rope"]["inv_freq"]), inv_freq.float())
    assert kept_inv_freq(s, 6) == s["rope"]["inv_freq"][:3]


def test_llama3_pairs_a_base_alone_cannot_reproduce():
    """Without per-pair frequencies in the model, a llama3 teacher's blended and divided pairs rotate
    differently in the student; with them, none do. An unscaled teacher never needs them."""
    plain = llama_shapes(teacher(1).config)
    cfg = student_config(teacher(1).config, ["mla", "mla"], kv_lora_rank=64, qk_rope_head_dim=16)
    assert rope_mismatch(plain, cfg.mla)["mismatched"] == 0 and cfg.mla.get("rope_inv_freq") is None
    model = teacher(1, rope_scaling=SCALINGS["llama3"])
    s = llama_shapes(model.config)
    cfg = student_config(model.config, ["mla", "mla"], kv_lora_rank=64, qk_rope_head_dim=16)
    assert rope_mismatch(s, cfg.mla)["mismatched"] == 0
    base_only = {k: v for k, v in cfg.mla.items() if k != "rope_inv_freq"}  # what a single base would give
    assert rope_mismatch(s, base_only)["mismatched"] == 7


def test_yarn_attention_scaling_goes_into_the_queries():
    """yarn scales cos and sin by its attention factor (every score by its square); with positions removed,
    at full rank the student reproduces that scaled attention exactly."""
    model = teacher(2, rope_scaling=SCALINGS["yarn"])
    factor = model.model.rotary_emb.attention_scaling
    assert factor != 1.0
    x = torch.randn(2, 23, 64)
    T = x.shape[1]
    cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
    ref = model.model.layers[0].self_attn(x, position_embeddings=(torch.full_like(cos, factor), torch.zeros_like(sin)),
                                          attention_mask=None)[0]
    assert rel_err(student_attention(model, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=0)(x), ref) < 1e-5


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_frequency_matched_rope_is_exact_for_a_scaled_teacher(kind):
    """Like the unscaled case above: one kv head, full rank, every head dim rotating, positions on; the
    student's pairs rotate at the teacher's scaled frequencies (and yarn's attention factor is kept)."""
    model = teacher(1, rope_scaling=SCALINGS[kind])
    x = torch.randn(2, 96, 64)  # past original_max_position_embeddings 64 (still inside 512 for dynamic)
    ref = teacher_attention(model, x, positions=True)
    assert rel_err(student_attention(model, 64, 64, qk_rope_head_dim=16)(x), ref) < 1e-5
