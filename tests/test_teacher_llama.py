"""Teachers as users hold them: a transformers Llama directory of sharded safetensors with an untied head and
llama3-scaled RoPE loads exactly and upcycles into loadable students; what the students cannot reproduce is a
one-line ConfigError before any weight is read."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import LLAMA3, REPO, save_sharded_llama3_teacher
from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridForCausalLM
from hybridlm.teacher import load_teacher
from upcycle.init_students import InitConfig, init_students
from upcycle.student import llama_shapes



@pytest.fixture(scope="module")
def sharded_teacher(tmp_path_factory):
    """Llama-3.1-8B's layout in miniature: untied head, 8 query / 2 KV heads, llama3 RoPE, two shards."""
    return save_sharded_llama3_teacher(tmp_path_factory.mktemp("teacher") / "llama", num_layers=2, num_heads=8,
                                       head_dim=8)


def test_sharded_untied_llama3_teacher_loads_exactly(sharded_teacher):
    path, model = sharded_teacher
    assert len(list(path.glob("model-*-of-*.safetensors"))) == 2
    loaded = load_teacher(path)
    assert loaded.config.rope_parameters["rope_type"] == "llama3"
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 1000, (2, 80))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_init_students_from_a_sharded_llama3_teacher(sharded_teacher, tmp_path):
    path, model = sharded_teacher
    summary = init_students(InitConfig(kv_lora_rank=16, qk_rope_head_dim=4, calib_tokens=256, calib_seq_len=64), path,
                            tmp_path / "init")
    s = llama_shapes(model.config)
    for kind in ("mla", "mamba2"):
        student = HybridForCausalLM.from_pretrained(tmp_path / "init" / f"{kind}_student")
        assert not student.config.tie_word_embeddings
        assert torch.equal(student.lm_head.weight, model.lm_head.weight)
        assert torch.equal(student.model.embed_tokens.weight, model.model.embed_tokens.weight)
    mla = HybridForCausalLM.from_pretrained(tmp_path / "init" / "mla_student").config.mla
    assert summary["rope"]["rope_type"] == "llama3" and summary["rope"]["pairs"] == 2
    assert mla["rope_inv_freq"] == s["rope"]["inv_freq"][:2] and summary["rope"]["mismatched"] == 0
    assert json.loads((tmp_path / "init" / "init_report.json").read_text())["rope"] == summary["rope"]


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral"}, "expected a Llama model (LlamaForCausalLM), found model_type 'mistral'"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "found architectures"),
    ({"attention_bias": True}, "attention_bias is true"),
    ({"mlp_bias": True}, "mlp_bias is true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "su-v2", "factor": 2.0}}, "rope type 'su-v2'"),
])
def test_unconvertible_teacher_is_one_line(tmp_path, change, message):
    cfg = json.loads((REPO / "configs/llama/llama-3.2-1b.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_teacher(tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def write_gguf(model, path, rope_factors=None, linear_factor=None):
    """``model`` as llama.cpp's converter writes a Llama: its tensor names, q / k rows permuted, and llama3 RoPE as
    the per-pair factor tensor ``rope_freqs.weight`` (base frequency / scaled frequency)."""
    import gguf
    cfg = model.config
    n_h, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_h)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0)
    if linear_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_factor)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, key in (("attn_norm", "input_layernorm"), ("attn_v", "self_attn.v_proj"),
                          ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            w.add_tensor(f"blk.{i}.{name}.weight", sd[p + key + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], n_h))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], n_kv))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", rope_factors.numpy().astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_llama(rope_scaling):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=False,
                      max_position_embeddings=512, rope_theta=10000.0, rope_scaling=rope_scaling)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_a_gguf_teacher_keeps_its_rope_scaling(tmp_path, kind):
    """transformers' GGUF loader reads neither llama.cpp's rope_freqs tensor nor its linear-scaling metadata;
    load_teacher puts the scaling back, so the GGUF teacher computes what the original model does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = dict(LLAMA3) if kind == "llama3" else {"rope_type": "linear", "factor": 4.0}
    model = small_llama(scaling)
    if kind == "llama3":
        base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        write_gguf(model, tmp_path / "m.gguf", rope_factors=base / ROPE_INIT_FUNCTIONS["llama3"](model.config, None)[0])
    else:
        write_gguf(model, tmp_path / "m.gguf", linear_factor=4.0)
    loaded = load_teacher(tmp_path / "m.gguf")
    rope = loaded.config.rope_parameters
    assert rope["rope_type"] == kind and rope["factor"] == scaling["factor"]
    if kind == "llama3":
        assert (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0)
        assert rope["original_max_position_embeddings"] == 64
    ids = torch.randint(0, 300, (1, 160))  # past original_max_position_embeddings
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).abs().max() < 1e-5
