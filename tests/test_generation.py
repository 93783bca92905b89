"""Cached generation (HybridCache, absorbed-weight MLA decode, recurrent mixer steps) against full forwards, CPU fp32."""
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import rel_err, tiny_config
from hybridlm.model import HybridForCausalLM
from hybridlm.model.cache import HybridCache, LatentCacheLayer, RecurrentCacheLayer
from hybridlm.model.generate import greedy_generate
from hybridlm.model.layers.delta_rule import DeltaRuleMixer
from hybridlm.model.layers.mamba2 import Mamba2
from upcycle.kv_report import kv_report

TOL = 1e-4
MODELS = {  # name -> (pattern, mixer); two blocks each so cache layers beyond index 0 are exercised
    "mla": ("*-*-", "gdn"),
    "gdn": ("M-M-", "gdn"),
    "kda": ("M-M-", "kda"),
    "mamba2": ("M-M-", "mamba2"),
    "mixed": ("*-G-K-S-", "gdn"),
}


def _model(name, seed=0):
    torch.manual_seed(seed)
    pattern, mixer = MODELS[name]
    return HybridForCausalLM(tiny_config(pattern, mixer=mixer)).eval()


def _ids(B, T, seed=1):
    return torch.randint(1, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def _worst_position_err(a, b):
    return max(rel_err(a[:, t], b[:, t]) for t in range(b.shape[1]))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("chunk,prompt_len", [(16, 1), (16, 7), (16, 33), (64, 33)])
@torch.no_grad()
def test_prefill_then_steps_match_full_forward(name, chunk, prompt_len, monkeypatch):
    monkeypatch.setattr(DeltaRuleMixer, "chunk_size", chunk)
    monkeypatch.setattr(Mamba2, "chunk_size", chunk)
    model = _model(name)
    blocks = [4] + [1] * 7  # a 4-token block continues the cache (masked absorbed MLA, chunked from a state), then steps
    ids = _ids(2, prompt_len + sum(blocks))
    full = model(input_ids=ids).logits
    out = model(input_ids=ids[:, :prompt_len], use_cache=True)
    cache, logits, t = out.cache, [out.logits], prompt_len
    for n in blocks:
        step = model(input_ids=ids[:, t:t + n], cache=cache)
        assert step.cache is cache
        logits.append(step.logits)
        t += n
    assert isinstance(cache, HybridCache) and cache.get_seq_length() == ids.shape[1]
    assert _worst_position_err(torch.cat(logits, 1), full) < TOL


@torch.no_grad()
def test_mla_decode_attends_to_the_latent_cache_only():
    """The cache holds only latent + RoPE key, and decoding never decompresses it through kv_b."""
    model = _model("mla")
    ids = _ids(2, 12)
    calls = []
    for block in model.model.layers:
        if block.kind == "mla":
            block.mixer.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
    cache = model(input_ids=ids[:, :9], use_cache=True).cache
    assert len(calls) == 2  # the prompt takes the expanded path, once per MLA layer
    for _ in range(3):
        model(input_ids=ids[:, 9:10], cache=cache)
    assert len(calls) == 2
    a = model.config.mixer_args("mla")
    mla_layers = [layer for layer, kind in zip(cache.layers, model.config.layer_plan) if kind == "mla"]
    assert len(mla_layers) == 2 and all(isinstance(layer, LatentCacheLayer) for layer in mla_layers)
    for layer in mla_layers:
        assert {k: tuple(v.shape) for k, v in layer.tensors().items()} == {
            "latent": (2, 12, a.kv_lora_rank), "k_rope": (2, 12, a.qk_rope_head_dim)}


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_equals_repeated_full_forwards(name):
    model = _model(name)
    ids = _ids(2, 7)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 17)
    assert torch.equal(out, greedy_generate(model, ids, 10))


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_left_padded_batch_equals_each_sequence_alone(name):
    model = _model(name)
    lengths, width = [3, 9, 6], 9
    prompts = [_ids(1, n, seed=10 + n) for n in lengths]
    batch = torch.cat([torch.nn.functional.pad(p, (width - p.shape[1], 0), value=0) for p in prompts])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(p), (width - p.shape[1], 0)) for p in prompts])

    generated = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    padded = model(input_ids=batch, attention_mask=mask, use_cache=True)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        alone = model(input_ids=p, use_cache=True)
        # logits of the real tokens, and the caches they leave behind, are those of the sequence alone
        assert rel_err(padded.logits[i, width - n:], alone.logits[0]) < TOL
        for lb, la in zip(padded.cache.layers, alone.cache.layers):
            if isinstance(lb, RecurrentCacheLayer):
                assert rel_err(lb.state[i], la.state[0]) < TOL
                for key in la.conv_states:
                    assert rel_err(lb.conv_states[key][i], la.conv_states[key][0]) < TOL
            elif isinstance(lb, LatentCacheLayer):
                assert rel_err(lb.latent[i, width - n:], la.latent[0]) < TOL
        want = model.generate(p, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(generated[i, width - n:], want[0]), f"row {i}"


@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
@torch.no_grad()
def test_mla_cache_bytes_per_token_match_kv_report(dtype, nbytes):
    pattern = "*-S-*-S-S-"  # 5 decoder blocks, MLA in blocks 0 and 2, Mamba2 elsewhere
    cfg = tiny_config(pattern, mixer="mamba2")
    model = HybridForCausalLM(cfg).to(dtype).eval()
    B, T = 2, 11
    cache = model(input_ids=_ids(B, T), use_cache=True).cache
    a = cfg.mixer_args("mla")
    per_token = (a.kv_lora_rank + a.qk_rope_head_dim) * nbytes * cfg.layer_plan.count("mla")
    assert cache.mla_bytes_per_token() == per_token
    assert cache.memory_bytes("mla") == B * T * per_token
    recurrent = cache.memory_bytes("recurrent")
    assert recurrent > 0 and cache.memory_bytes() == recurrent + B * T * per_token
    model(input_ids=_ids(B, 1), cache=cache)  # one more token: only the MLA latents grow
    assert cache.memory_bytes("mla") == B * (T + 1) * per_token and cache.memory_bytes("recurrent") == recurrent

    mla_blocks = [i // 2 for i, ch in enumerate(pattern) if ch == "*"]
    teacher = dict(num_hidden_layers=len(pattern) // 2, num_attention_heads=4, hidden_size=cfg.hidden_size)
    report = kv_report(teacher, mla_blocks, a.kv_lora_rank, a.qk_rope_head_dim, bytes_per_value=nbytes)
    assert report["hybrid_bytes_per_token"] == cache.mla_bytes_per_token()


def test_saved_model_generates_through_auto_class(tmp_path):
    model = _model("mixed")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HybridForCausalLM)
    ids = _ids(1, 5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, **kwargs), model.generate(ids, **kwargs))
    with pytest.raises(TypeError, match="HybridCache"):
        loaded(input_ids=ids, cache=DynamicCache())


@torch.no_grad()
def test_beam_search_reorders_the_cache_and_crop_refuses_recurrent_rollback():
    model = _model("mixed")
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, num_beams=3, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))
    cache = model(input_ids=ids, use_cache=True).cache
    with pytest.raises(NotImplementedError):
        cache.crop(-1)
    assert cache.get_seq_length() == 6  # nothing was cut, MLA layers included
    assert all(layer.latent.shape[1] == 6 for layer in cache.layers if isinstance(layer, LatentCacheLayer))
