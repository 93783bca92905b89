"""KV-cache accounting (hybridlm.kv_report) against the published ratios."""
import json
from pathlib import Path

import pytest

from hybridlm.config.errors import ConfigError
from hybridlm.kv_report import format_kv_report, kv_report, load_teacher_config

REPO = Path(__file__).resolve().parents[1]
LLAMA_DIR = REPO / "configs" / "llama"


def spread(L, n):
    """Any n distinct layers: the ratio depends only on how many are MLA."""
    return list(range(0, L, L // n))[:n]


@pytest.mark.parametrize("name, n_mla, kv_lora_rank, qk_rope_head_dim, expected", [
    ("llama-3.2-1b", 8, 128, 32, 12.8), ("llama-3.2-1b", 4, 128, 32, 25.6),
    ("llama-3.2-3b", 14, 128, 64, 21.3), ("llama-3.2-3b", 6, 128, 64, 49.8),
    ("llama-3.1-8b", 16, 160, 64, 18.3), ("llama-3.1-8b", 8, 160, 64, 36.6),
])
def test_published_ratios(name, n_mla, kv_lora_rank, qk_rope_head_dim, expected):
    cfg = load_teacher_config(LLAMA_DIR / f"{name}.json")
    rep = kv_report(cfg, spread(cfg.num_hidden_layers, n_mla), kv_lora_rank, qk_rope_head_dim)
    assert round(rep["compression"], 1) == expected
    assert rep["ratio"] == pytest.approx(1 / rep["compression"])
    L, n_kv, d_h = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    assert rep["teacher_values_per_token"] == L * 2 * n_kv * d_h
    assert rep["hybrid_values_per_token"] == n_mla * (kv_lora_rank + qk_rope_head_dim)
    assert rep["teacher_bytes_per_token"] == 2 * rep["teacher_values_per_token"]
    assert rep["hybrid_bytes_per_token"] == 2 * rep["hybrid_values_per_token"]
    assert len(rep["per_layer"]) == L
    assert sum(r["hybrid_values"] for r in rep["per_layer"]) == rep["hybrid_values_per_token"]
    assert [r["layer"] for r in rep["per_layer"] if r["kind"] == "mla"] == rep["mla_layers"]


def test_1b_exact_percentage_and_dict_input():
    cfg = dict(num_hidden_layers=16, num_key_value_heads=8, num_attention_heads=32, hidden_size=2048)  # head_dim derived
    rep = kv_report(cfg, [0, 2, 4, 6, 8, 10, 12, 14], 128, 32, bytes_per_value=4)
    assert rep["ratio"] == 0.078125  # 7.81 % exactly
    assert rep["teacher_values_per_token"] == 16384 and rep["hybrid_values_per_token"] == 1280
    assert rep["teacher_bytes_per_token"] == 65536
    text = format_kv_report(rep)
    assert "12.8x" in text and "7.81%" in text and "8 MLA + 8 linear of 16 layers" in text
    assert "8 linear layers not counted (mixer not named)" in text and rep["hybrid_state_values"] is None


@pytest.mark.parametrize("linear", ["mamba2", "gdn", "kda"])
def test_the_linear_layers_are_named_with_their_state(linear):
    from hybridlm.model.registry import costs_of, mixer_spec
    teacher = dict(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=4, hidden_size=256)
    args = mixer_spec(linear).args(conv_size=2)
    args.finalize(256, linear)
    rep = kv_report(teacher, [1, 3], 32, 8, linear_mixer=linear, mixer_args={linear: args})
    state = costs_of(linear).state_per_sequence(args)
    defaults = mixer_spec(linear).args()  # not given: the registered defaults at the teacher's width
    defaults.finalize(256, linear)
    assert kv_report(teacher, [1, 3], 32, 8, linear_mixer=linear)["mixers"][0]["state_values"] == \
        costs_of(linear).state_per_sequence(defaults) > state
    assert [r["kind"] for r in rep["per_layer"]] == [linear, "mla", linear, "mla"]
    assert [r["state_values"] for r in rep["per_layer"]] == [state, 0, state, 0] and rep["hybrid_state_values"] == 2 * state
    assert rep["hybrid_values_per_token"] == 2 * 40
    title = mixer_spec(linear).name
    text = format_kv_report(rep)
    assert f"KV cache: 2 {title} + 2 MLA of 4 layers (values per token and layer: {title} 0, MLA 40;" in text
    assert f"fixed-size state per sequence: {title} 2 x {state:,} = {2 * state:,} values" in text
    with pytest.raises(ConfigError, match="unknown mixer 'lstm'"):
        kv_report(teacher, [1, 3], 32, 8, linear_mixer="lstm")
    with pytest.raises(ConfigError, match="KV-cache layers are"):
        kv_report(teacher, [1, 3], 32, 8, layer_kinds=[linear, "mla", linear, linear])


def test_shipped_configs_match_the_public_shapes():
    want = {"llama-3.2-1b": (2048, 16, 32, 64, 8192, True), "llama-3.2-3b": (3072, 28, 24, 128, 8192, True),
            "llama-3.1-8b": (4096, 32, 32, 128, 14336, False)}
    for name, (h, L, nh, dh, ffn, tie) in want.items():
        raw = json.loads((LLAMA_DIR / f"{name}.json").read_text())
        assert (raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"], raw["head_dim"],
                raw["intermediate_size"], raw["tie_word_embeddings"]) == (h, L, nh, dh, ffn, tie)
        assert raw["num_key_value_heads"] == 8 and raw["vocab_size"] == 128256 and raw["model_type"] == "llama"
        cfg = load_teacher_config(name)  # public name works as well as the path
        assert cfg.hidden_size == h and cfg.rope_parameters["rope_theta"] == 500000.0
        assert cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings is tie


def test_loader_accepts_directory_and_file(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text((LLAMA_DIR / "llama-3.2-3b.json").read_text())
    assert load_teacher_config(d).num_hidden_layers == 28
    assert load_teacher_config(d / "config.json").head_dim == 128


def test_loader_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_teacher_config(tmp_path / "missing")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        load_teacher_config(bad)
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_teacher_config(tmp_path)
    bad.write_text(json.dumps({"model_type": "mistral", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="model_type"):
        load_teacher_config(bad)


def test_layer_errors():
    cfg = load_teacher_config("llama-3.2-1b")
    with pytest.raises(ConfigError, match=r"^mla_layers: index 16 out of range for a 16-layer teacher$"):
        kv_report(cfg, [0, 16], 128, 32)
    with pytest.raises(ConfigError, match="mla_layers: index -1"):
        kv_report(cfg, [-1], 128, 32)
    with pytest.raises(ConfigError, match="mla_layers: layer 4 is listed more than once"):
        kv_report(cfg, [0, 4, 4], 128, 32)
    with pytest.raises(ConfigError, match="mla_layers"):
        kv_report(cfg, [0, 1.5], 128, 32)
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        kv_report(cfg, [0], 0, 32)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        kv_report(dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=3, hidden_size=64), [0], 8, 0)


def test_all_linear_has_no_kv_cache():
    rep = kv_report(load_teacher_config("llama-3.2-1b"), [], 128, 32)
    assert rep["hybrid_values_per_token"] == 0 and rep["ratio"] == 0 and rep["compression"] is None
    assert "inf" in format_kv_report(rep)
