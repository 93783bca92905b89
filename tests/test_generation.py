"""Cached generation (HybridCache, absorbed-weight MLA decode, recurrent mixer steps) against full forwards, CPU fp32."""
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import count_graphed_generate, rel_err, tiny_config
from hybridlm.model import HybridForCausalLM
from hybridlm.model.cache import HybridCache, LatentCacheLayer, RecurrentCacheLayer
from hybridlm.model.generate import greedy_generate
from hybridlm.model.layers.delta_rule import DeltaRuleMixer
from hybridlm.model.layers.mamba2 import Mamba2
from hybridlm.kv_report import kv_report

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


# ------------------------------------------------------------------------- static cache (CUDA graphs)

def _static(model, max_length, batch):
    return HybridCache(model.config, max_length=max_length, batch_size=batch, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("prompt_len", [1, 7])
@torch.no_grad()
def test_static_cache_matches_dynamic_cache_and_full_forward(name, prompt_len, monkeypatch):
    """Prefill (shorter than max_length), a 3-token block, then single steps up to exactly max_length; then full."""
    monkeypatch.setattr(DeltaRuleMixer, "chunk_size", 16)
    monkeypatch.setattr(Mamba2, "chunk_size", 16)
    model = _model(name)
    max_length = prompt_len + 3 + 8
    ids = _ids(2, max_length)
    full = model(input_ids=ids).logits
    static, dynamic = _static(model, max_length, 2), model(input_ids=ids[:, :prompt_len], use_cache=True).cache
    assert static.is_static and not dynamic.is_static and static.get_max_length() == max_length
    out = model(input_ids=ids[:, :prompt_len], cache=static)
    assert out.cache is static and static.get_seq_length() == prompt_len and static.length.tolist() == [prompt_len]
    # the preallocated shapes are the dynamic cache's (MLA: max_length positions instead of the prompt's)
    for ls, ld in zip(static.layers, dynamic.layers):
        assert ls.tensors().keys() == ld.tensors().keys()
        for key, t in ld.tensors().items():
            want = (t.shape[0], max_length, *t.shape[2:]) if isinstance(ld, LatentCacheLayer) else t.shape
            assert ls.tensors()[key].shape == want, key
    logits, dyn_logits, t = [out.logits], [], prompt_len
    ptrs = {k: v.data_ptr() for k, v in static.static_tensors().items()}
    for n in [3] + [1] * 8:
        logits.append(model(input_ids=ids[:, t:t + n], cache=static).logits)
        dyn_logits.append(model(input_ids=ids[:, t:t + n], cache=dynamic).logits)
        t += n
    assert static.get_seq_length() == max_length == dynamic.get_seq_length()
    assert {k: v.data_ptr() for k, v in static.static_tensors().items()} == ptrs  # updated in place only
    logits = torch.cat(logits, 1)
    assert _worst_position_err(logits, full) < TOL
    assert _worst_position_err(logits[:, prompt_len:], torch.cat(dyn_logits, 1)) < TOL
    for ls, ld in zip(static.layers, dynamic.layers):  # the same cached contents
        for key, t in ld.tensors().items():
            assert rel_err(ls.tensors()[key], t) < TOL, key
    with pytest.raises(ValueError, match="max_length"):
        model(input_ids=ids[:, :1], cache=static)
    assert static.get_seq_length() == max_length  # the refused step changed nothing

    static.reset()  # in place: the same buffers serve a new generation
    assert static.get_seq_length() == 0 and static.length.tolist() == [0]
    assert {k: v.data_ptr() for k, v in static.static_tensors().items()} == ptrs
    assert rel_err(model(input_ids=ids[:, :prompt_len + 3], cache=static).logits, full[:, :prompt_len + 3]) < TOL


@torch.no_grad()
def test_static_cache_refusals():
    model = _model("mixed")
    ids = _ids(2, 6)
    with pytest.raises(ValueError, match="max_length"):
        model(input_ids=ids, cache=_static(model, 5, 2))  # a prompt longer than the cache
    cache = _static(model, 8, 2)
    with pytest.raises(ValueError, match="batch"):
        model(input_ids=ids[:1], cache=cache)
    cache = _static(model, 8, 2)
    mask = torch.ones_like(ids)
    model(input_ids=ids, attention_mask=mask, cache=cache)  # an all-ones mask is accepted
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(NotImplementedError, match="padding"):
        model(input_ids=ids[:, :1], attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=ids[:, :1], position_ids=torch.tensor([[6]]), cache=cache)
    with pytest.raises(NotImplementedError):
        cache.crop(-1)
    with pytest.raises(NotImplementedError):
        cache.batch_repeat_interleave(2)


@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
@torch.no_grad()
def test_static_cache_memory_bytes_allocated_and_used(dtype, nbytes):
    """``memory_bytes()`` of a static cache is what it allocated (all max_length positions, from the start);
    ``used=True`` counts the MLA positions written so far, which is a dynamic cache's ``memory_bytes()``."""
    cfg = tiny_config("*-S-*-S-S-", mixer="mamba2")
    torch.manual_seed(0)
    model = HybridForCausalLM(cfg).to(dtype).eval()
    B, T, N = 2, 11, 16
    static = HybridCache(cfg, max_length=N, batch_size=B, dtype=dtype)
    a = cfg.mixer_args("mla")
    per_token = (a.kv_lora_rank + a.qk_rope_head_dim) * nbytes * cfg.layer_plan.count("mla")
    assert static.mla_bytes_per_token() == per_token
    recurrent = static.memory_bytes("recurrent")
    assert static.memory_bytes() == B * N * per_token + recurrent and static.memory_bytes(used=True) == recurrent
    ids = _ids(B, T)
    dynamic = model(input_ids=ids, use_cache=True).cache
    model(input_ids=ids, cache=static)
    assert static.memory_bytes() == B * N * per_token + recurrent  # allocated: unchanged
    assert static.memory_bytes(used=True) == dynamic.memory_bytes() == dynamic.memory_bytes(used=True)
    assert static.memory_bytes("mla", used=True) == dynamic.memory_bytes("mla") == B * T * per_token
    assert static.memory_bytes("recurrent") == dynamic.memory_bytes("recurrent") == recurrent


@pytest.mark.parametrize("name", ["mla", "mixed"])
@torch.no_grad()
def test_graphed_decoder_on_cpu_equals_the_plain_loop(name):
    """Without CUDA the decoder runs the model eagerly on the static cache: the greedy tokens are those of the
    dynamic-cache loop and of full forwards; it refuses a step beyond max_length."""
    from hybridlm.model.graphs import GraphedDecoder
    model = _model(name)
    ids, new = _ids(2, 7), 9
    cache = _static(model, ids.shape[1] + new - 1, 2)
    decoder = GraphedDecoder(model, cache)
    assert not decoder.enabled and decoder.graph is None
    nxt = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    tokens = [nxt]
    snap = cache.snapshot()  # what capture() does around its warm-up runs: a step, undone exactly
    first = decoder.step(nxt).clone()
    cache.restore(snap)
    assert cache.get_seq_length() == ids.shape[1] and cache.length.tolist() == [ids.shape[1]]
    for _ in range(new - 1):
        logits = decoder.step(nxt)
        if len(tokens) == 1:
            assert torch.equal(logits, first)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
    assert cache.get_seq_length() == cache.max_length
    with pytest.raises(ValueError, match="full"):
        decoder.step(nxt)

    out = model(input_ids=ids, use_cache=True)
    plain = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new - 1):
        plain.append(model(input_ids=plain[-1], cache=out.cache).logits[:, -1].argmax(-1, keepdim=True))
    assert torch.equal(torch.cat(tokens, 1), torch.cat(plain, 1))
    assert torch.equal(torch.cat(tokens, 1), greedy_generate(model, ids, new)[:, ids.shape[1]:])
    with pytest.raises(ValueError, match="static"):
        GraphedDecoder(model, out.cache)


@torch.no_grad()
def test_graphed_generate_gives_generates_tokens():
    """graphed_generate (static cache + GraphedDecoder, eager on CPU) against transformers' generate(): greedy,
    with an EOS that ends one row early (padded, as generate() pads) and then all rows; sampling: seeded and
    repeatable, top_k=1 is greedy."""
    from hybridlm.model.graphs import STOP_CHECK_EVERY, graphed_generate
    model = _model("mixed")
    ids, new = _ids(2, 7), 10
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0)
    got = graphed_generate(model, ids, new)
    assert torch.equal(got, want)

    eos = int(want[0, 7 + 2])  # row 0's third new token
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want_eos = model.generate(ids, **kw)
    got_eos = graphed_generate(model, ids, new, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got_eos, want_eos)
    assert (got_eos[0, 7 + 3:] == 0).all()  # row 0 padded after its EOS

    # every row finished: both stop at the last row's EOS, also past a host check (STOP_CHECK_EVERY steps)
    long_new = STOP_CHECK_EVERY + 8
    first = graphed_generate(model, ids[:1], long_new)
    eos = int(first[0, 7 + 1])
    want_stop = model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=long_new,
                               do_sample=False, eos_token_id=eos, pad_token_id=0)
    got_stop = graphed_generate(model, ids[:1], long_new, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got_stop, want_stop) and got_stop.shape[1] < 7 + long_new

    def sample(seed, **kw):
        return graphed_generate(model, ids, new, do_sample=True, generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(sample(3, temperature=0.7), sample(3, temperature=0.7))
    assert not torch.equal(sample(3, temperature=5.0), sample(4, temperature=5.0))
    assert torch.equal(sample(5, top_k=1), got)
    with pytest.raises(ValueError, match="max_new_tokens"):
        graphed_generate(model, ids, 0)


@torch.no_grad()
def test_graphed_generate_keeps_its_cache_and_step_for_the_next_call_of_the_same_shape():
    """The static cache (and on CUDA the captured step) of a call stays on the model: the next call of the same
    shape reuses it, emptied, with nothing of the last prompt left in it; another shape, replaced weights or a
    switched decode kernel build a new one; a copy of the model does not share it; release frees it."""
    import copy
    import pickle
    from hybridlm.model.graphs import KeptDecoder, graphed_generate

    model = _model("mixed")
    new = 9

    def reference(ids):  # transformers' loop, nothing kept
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)

    a, b = _ids(2, 7, seed=1), _ids(2, 7, seed=2)
    assert torch.equal(graphed_generate(model, a, new), reference(a))
    kept = model.__dict__["_kept_decoder"]
    first = kept.decoder
    assert torch.equal(graphed_generate(model, b, new), reference(b))  # the same cache, emptied in place
    assert kept.decoder is first
    assert torch.equal(graphed_generate(model, a, 1), reference(a)[:, :8]) and kept.decoder is first  # no decode
    assert torch.equal(graphed_generate(model, a[:1], new), reference(a[:1])) and kept.decoder is not first
    second = kept.decoder
    model.set_runtime(mla_split_k_decode=False)  # what the captured step runs changed: not the same step
    graphed_generate(model, a[:1], new)
    assert kept.decoder is not second
    model.set_runtime(mla_split_k_decode=True)
    third = kept.decoder
    model.double()  # new weight tensors: a graph of the old ones must not be replayed
    assert torch.equal(graphed_generate(model, a[:1], new), reference(a[:1]))
    assert kept.decoder is not third and kept.key[1] == torch.float64

    twin = copy.deepcopy(model)
    assert twin.__dict__["_kept_decoder"].decoder is None and kept.decoder is not None
    assert torch.equal(graphed_generate(twin, a, new), reference(a))
    assert pickle.loads(pickle.dumps(kept)).decoder is None
    model.release_generation_graph()
    assert kept.decoder is None and kept.key is None and isinstance(kept, KeptDecoder)


@torch.no_grad()
def test_generate_takes_the_fast_path_when_it_computes_the_same(caplog, monkeypatch):
    """model.generate(): a call the static cache serves (rows of one length; greedy, EOS, sampling) goes through
    graphed_generate (fast_path=True forces it on a CPU; on CUDA it is the default) and gives transformers' own
    loop's greedy tokens; a call it cannot serve takes transformers' loop and says why once."""
    from hybridlm.model import fast_generate
    from hybridlm.model.fast_generate import fast_path_plan

    model = _model("mixed")
    ids, new = _ids(2, 7), 12
    calls = count_graphed_generate(monkeypatch)
    mask = torch.ones_like(ids)
    slow = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert not calls  # a CPU model: transformers' loop unless asked
    fast = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          fast_path=True)
    assert len(calls) == 1 and torch.equal(fast, slow)
    eos = int(slow[0, 7 + 2])
    kw = dict(attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(model.generate(ids, fast_path=True, **kw), model.generate(ids, fast_path=False, **kw))
    assert len(calls) == 2
    # sampling (temperature, transformers' default top-k of 50): repeatable under the global seed; top_k=1 is
    # greedy (tests/test_generate_fast_path.py compares sampled tokens with transformers' loop)
    def sample(seed, **kw):
        torch.manual_seed(seed)
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=True, pad_token_id=0,
                              fast_path=True, **kw)
    assert torch.equal(sample(11, temperature=0.8), sample(11, temperature=0.8))
    assert calls[-1]["temperature"] == 0.8 and calls[-1]["top_k"] == 50
    assert torch.equal(sample(12, top_k=1), slow) and len(calls) == 5
    # what it cannot serve: transformers' loop, with the reason
    padded = mask.clone()
    padded[0, 0] = 0
    for extra, reason in ((dict(num_beams=2), "beam_search"), (dict(do_sample=True, top_p=0.9), "TopPLogitsWarper"),
                          (dict(attention_mask=padded), "padded rows"),
                          (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
                          (dict(eos_token_id=[1, 2]), "several EOS"), (dict(streamer=object()), "'streamer'")):
        plan, why = fast_path_plan(model, ids, None, {"attention_mask": mask, "max_new_tokens": 4,
                                                      "fast_path": True, **extra})
        assert plan is None and reason in why, (extra, why)
    fast_generate._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="hybridlm.model.fast_generate"):
        for _ in range(2):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False,
                                 pad_token_id=0, fast_path=True)
    assert out.shape == (2, 10) and len(calls) == 5
    said = [r for r in caplog.records if "beam_search" in r.getMessage()]
    assert len(said) == 1  # once
