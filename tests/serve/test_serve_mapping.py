"""The vLLM plugin's config checks and weight mapping (hybridlm/serve/mapping.py), without vLLM: these run in the
main test environment too."""
import pytest
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.serve.mapping import (attention_head_size, check_servable, expand_mamba2_channels,
                                    expanded_mamba2_config_values, mamba2_widths, served_weights)
from tests.serve.export import build_model

VOCAB = 512  # the mapping does not care about the vocabulary: small models, fast tests


@pytest.fixture(scope="module")
def upcycled():
    return build_model(vocab_size=VOCAB)


def test_an_upcycled_mla_mamba2_stack_is_servable(upcycled):
    c = upcycled.config
    check_servable(c)
    a = c.mixer_args("mamba2")
    assert a.d_xb < a.d_inner and a.gate_bias and not c.mixer_args("mla").latent_norm  # the MambaInLlama shapes
    assert c.mixer_args("mla").rope_inv_freq is not None
    w = mamba2_widths(c)
    assert (w.d_xb, w.d_b, w.d_c, w.repeat, w.conv_dim) == (32, 32, 64, 2, 64 + 2 * 64)
    assert attention_head_size(c) == 32  # qk 8 + 8, v 16: padded to the smallest supported size


@pytest.mark.parametrize("kind,symbol,title", [("gdn", "G", "GDN"), ("kda", "K", "KDA")])
def test_a_mixer_vllm_cannot_run_is_refused_naming_the_layer(upcycled, kind, symbol, title):
    model = build_model(vocab_size=VOCAB, kinds=("mla", kind, "mamba2", "mla"))
    with pytest.raises(ConfigError, match=rf"hybrid_override_pattern: layer 2 is {title} \('{symbol}'\); serving "
                                          r"with vLLM runs MLA"):
        check_servable(model.config)


@pytest.mark.parametrize("kinds,missing", [(("mla",) * 4, "Mamba2"), (("mamba2",) * 4, r"MLA \('\*'\)")])
def test_a_stack_without_mla_or_without_mamba2_is_refused(kinds, missing):
    model = build_model(vocab_size=VOCAB, kinds=kinds)
    with pytest.raises(ConfigError, match=rf"hybrid_override_pattern: '.*' has no {missing} layer; serving with vLLM "
                                          r"takes stacks with both MLA and Mamba2 layers"):
        check_servable(model.config)


def test_attention_heads_are_padded_to_a_size_the_kernels_take():
    def head(nope, rope, v):
        return attention_head_size(HybridConfig(vocab_size=64, hidden_size=64, hybrid_override_pattern="*-",
                                                mla=dict(num_heads=2, q_lora_rank=0, kv_lora_rank=16,
                                                         qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)))
    assert head(16, 16, 32) == 32
    assert head(32, 16, 32) == 64   # qk 48 -> 64
    assert head(64, 64, 128) == 128
    assert head(128, 64, 128) == 192
    with pytest.raises(ConfigError, match=r"mla: qk_nope_head_dim \+ qk_rope_head_dim \(640\) .* at most 512"):
        head(576, 64, 64)


def _expanded_twin(model: HybridForCausalLM) -> HybridForCausalLM:
    """The same model with every Mamba2 layer in the plain layout (no d_xb), its weights mapped by
    :func:`expand_mamba2_channels`: the layout vLLM's Mamba2 runs."""
    values = model.config.to_dict()
    values["mamba2"] = expanded_mamba2_config_values(model.config)
    twin = HybridForCausalLM(HybridConfig(**{k: v for k, v in values.items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "hybrid_override_pattern", "mixer", "rms_norm_eps",
        "tie_word_embeddings", "mla", "mamba2")}), runtime={"backend": "torch"}).eval()
    state = {}
    d_inner = model.config.mixer_args("mamba2").d_inner
    for name, t in model.state_dict().items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and model.config.layer_plan[int(parts[2])] == "mamba2":
            if name.endswith("mixer.in_proj.weight"):
                t = expand_mamba2_channels(t, model.config, d_inner)
            elif name.endswith(("mixer.conv1d.weight", "mixer.conv1d.bias")):
                t = expand_mamba2_channels(t, model.config, 0)
        state[name] = t
    twin.load_state_dict(state, strict=True)
    return twin


@torch.no_grad()
def test_repeating_x_and_b_channels_keeps_the_mamba2_function(upcycled):
    # MambaInLlama's shared x / B (repeated after the conv) equals the plain layout with the rows and conv
    # channels repeated before it: what the plugin hands vLLM's Mamba2
    twin = _expanded_twin(upcycled)
    assert twin.config.mixer_args("mamba2").d_xb is None
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(3))
    want, got = upcycled(input_ids=ids).logits, twin(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_served_weights_names_and_shapes(upcycled):
    c, a = upcycled.config, upcycled.config.mixer_args("mamba2")
    w = mamba2_widths(c)
    out = dict(served_weights(c, upcycled.state_dict().items()))
    d, f = c.hidden_size, c.intermediate_size
    assert "lm_head.weight" not in out  # tied: vLLM ties lm_head to the embeddings
    m = "model.layers.2.mixer."
    assert out[m + "in_proj.weight"].shape == (2 * w.d_inner + 2 * w.d_c + w.heads, d)
    assert out[m + "conv1d.weight"].shape == (w.conv_dim, 1, a.conv_size)
    assert out[m + "conv1d.bias"].shape == (w.conv_dim,)
    assert out[m + "norm.weight"].shape == (w.d_inner,)
    assert torch.equal(out[m + "A"], upcycled.state_dict()[m + "A_log"])  # vLLM's loader takes -exp itself
    bias = out[m + "in_proj.bias"]
    assert torch.equal(bias[:w.d_inner], upcycled.state_dict()[m + "z_bias"]) and not bias[w.d_inner:].any()
    assert not out[m + "out_proj.bias"].any()
    mlp = "model.layers.1.mixer."
    sd = upcycled.state_dict()
    gate_up = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
    assert torch.equal(out[mlp + "gate_up_proj.weight"], gate_up)
    assert out[mlp + "gate_up_proj.weight"].shape == (2 * f, d)
    assert {k for k in out if ".layers.0." in k} == {k for k in sd if ".layers.0." in k}  # MLA: names unchanged
    assert not any(k.endswith(("A_log", "norm_weight", "z_bias", ".gate_proj.weight", ".up_proj.weight")) for k in out)


def test_served_weights_refuse_an_mlp_half(upcycled):
    sd = {k: v for k, v in upcycled.state_dict().items() if k != "model.layers.1.mixer.up_proj.weight"}
    with pytest.raises(ConfigError, match=r"weights: model.layers.1.mixer. has gate_proj or up_proj without the other"):
        list(served_weights(upcycled.config, sd.items()))
