"""Cached decoding on the GPU path (fla's chunk kernels from a state, fused recurrent steps) against the same
model's full forward, left-padded batches against each sequence alone, eager steps on a static cache against
transformers' loop, and captured CUDA graphs against eager steps. On CUDA at the 300M shapes; under Triton's
interpreter at conftest's tiny shapes, the CUDA graph tests skipped (tests/support/gpu_path.py)."""
import json
import os

import pytest
import torch

from conftest import greedy_decode, tiny_config
from benchmarks.harness.mixers import SHAPES_300M
from hybridlm.model import HybridConfig, HybridForCausalLM
from tests.support.gpu_path import DEVICE, generator, place, scaled

pytestmark = [pytest.mark.gpu]

# fla's kernels use TF32 dots for fp32 inputs and round every intermediate in bf16 (see the parity tests)
TOL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}
PATTERNS = {"mla": ("*-*-", "gdn"), "gdn": ("M-M-", "gdn"), "kda": ("M-M-", "kda"), "mamba2": ("M-M-", "mamba2"),
            "mixed": ("*-G-K-S-", "gdn")}
VOCAB = scaled(4096, 512)
PROMPT = scaled(300, 70)  # past fla's 64-token chunk
# under the interpreter the model of every sublayer kind only: a model of one kind runs the same kernels
DECODED = scaled(list(PATTERNS), ["mixed"])


def _model(name, dtype):
    """The 300M shapes on CUDA, conftest's tiny ones under the interpreter (backend triton there)."""
    pattern, mixer = PATTERNS[name]
    torch.manual_seed(0)
    cfg = scaled(HybridConfig(**{**SHAPES_300M, "vocab_size": VOCAB, "hybrid_override_pattern": pattern,
                                 "mixer": mixer}),
                 tiny_config(pattern, mixer, vocab_size=VOCAB))
    return place(HybridForCausalLM(cfg), dtype).eval()


def _ids(*shape, seed=0):
    return torch.randint(1, VOCAB, shape, device=DEVICE, generator=generator(seed))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _record(name, value):
    path = os.environ.get("HYBRIDLM_PARITY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": name, "rel_err": value}) + "\n")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", DECODED)
@torch.no_grad()
def test_cached_decode_matches_full_forward(name, dtype):
    model = _model(name, dtype)
    ids = _ids(2, PROMPT + 8)
    full = model(input_ids=ids).logits
    out = model(input_ids=ids[:, :PROMPT], use_cache=True)
    logits = [out.logits]
    for t in range(PROMPT, ids.shape[1]):
        logits.append(model(input_ids=ids[:, t:t + 1], cache=out.cache).logits)
    # the prompt's last position and every step
    err = _rel(torch.cat(logits, 1)[:, PROMPT - 1:], full[:, PROMPT - 1:])
    _record(f"generation/{name}/{str(dtype).split('.')[-1]}", err)
    assert err < TOL[dtype]


@pytest.mark.parametrize("name", DECODED)
@torch.no_grad()
def test_left_padded_batch_decodes_like_each_sequence_alone(name):
    """Teacher-forced through the cache (greedy tokens would flip on near-ties of a random model)."""
    model = _model(name, torch.float32)
    a, b, follow = _ids(1, 37), _ids(1, 80, seed=1), _ids(2, 6, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 43, dtype=a.dtype, device=DEVICE), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :43] = 0

    def decode(ids, mask, steps):
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        logits = [out.logits[:, -1:]]
        for t in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits.append(model(input_ids=steps[:, t:t + 1], attention_mask=mask, cache=out.cache).logits)
        return torch.cat(logits, 1)

    together = decode(batch, mask, follow)
    alone = torch.cat([decode(x, torch.ones_like(x), follow[i:i + 1]) for i, x in enumerate((a, b))])
    err = _rel(together, alone)
    _record(f"generation/{name}/left_padding", err)
    assert err < TOL[torch.float32]


@torch.no_grad()
def test_static_cache_eager_decode_matches_transformers_loop():
    """A static HybridCache decoded through eager single-token steps (GraphedDecoder without a CUDA graph) on every
    sublayer kind against transformers' own loop on the dynamic cache (``generate(fast_path=False)``), fp32 greedy:
    teacher-forced with the loop's tokens, the same logits and so the same greedy tokens; then graphed_generate
    without a graph against the loop with an EOS half-way."""
    from hybridlm.model.cache import HybridCache
    from hybridlm.model.graphs import GraphedDecoder, graphed_generate
    model = _model("mixed", torch.float32)
    B, P, new = scaled((3, 137, 40), (2, 16, 8))
    ids = _ids(B, P)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0,
              fast_path=False)
    loop = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
    tokens = loop.sequences[:, P:]
    assert tokens.shape[1] == new

    cache = HybridCache(model.config, max_length=P + new - 1, batch_size=B, dtype=torch.float32, device=DEVICE)
    decoder = GraphedDecoder(model, cache, enabled=False)
    logits = [model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1]]
    logits += [decoder.step(t)[:, -1] for t in tokens[:, :-1].split(1, 1)]
    logits = torch.stack(logits, 1)
    assert decoder.graph is None and cache.get_seq_length() == P + new - 1
    err = _rel(logits, torch.stack(loop.logits, 1))
    _record("generation/mixed/float32/static_cache", err)
    assert err < TOL[torch.float32]
    assert torch.equal(logits.argmax(-1), tokens)

    eos = int(tokens[1, new // 2])  # row 1 ends half-way
    assert torch.equal(graphed_generate(model, ids, new, eos_token_id=eos, pad_token_id=0, cuda_graph=False),
                       model.generate(ids, eos_token_id=eos, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(PATTERNS))
@torch.no_grad()
def test_cuda_graph_decode_equals_eager_static_cache(name, dtype):
    """GraphedDecoder's replayed steps against eager steps on a static cache under FIXED_SHAPES (same kernels:
    equal up to nondeterminism), greedy tokens included, and the static cache's eager steps against the dynamic
    cache. The captured step's kernel switches are off here, so both sides run the same ops; each switch on against
    off is test_captured_step_with_a_kernel_switch_decodes_like_without_it."""
    from hybridlm.model.cache import FIXED_SHAPES, HybridCache
    model = _model(name, dtype)
    model.set_runtime(graph_small_kernels=False, graph_fuse_residual=False)
    B, P, new = 3, 137, 12
    ids = _ids(B, P)

    def static_cache():
        return HybridCache(model.config, max_length=P + new - 1, batch_size=B, dtype=dtype, device=DEVICE)

    def prefill(cache):
        return model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1:]

    eager_cache = static_cache()
    first = prefill(eager_cache)
    eager_logits, eager_tokens = [first], [first[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new - 1):
        with FIXED_SHAPES.on():  # the captured step's shapes: attention over the whole buffer, as in the graph
            eager_logits.append(model(input_ids=eager_tokens[-1], cache=eager_cache).logits)
        eager_tokens.append(eager_logits[-1][:, -1].argmax(-1, keepdim=True))

    graph_cache = static_cache()
    # teacher-forced with the eager tokens, so one near-tie cannot derail the rest
    graph_tokens, graph_logits, _, decoder = greedy_decode(model, ids, new, graph_cache,
                                                           forced=torch.cat(eager_tokens, 1))
    assert decoder.enabled and decoder.graph is not None and graph_cache.get_seq_length() == P + new - 1
    assert graph_cache.length.item() == P + new - 1
    with pytest.raises(ValueError, match="full"):
        decoder.step(eager_tokens[-1])
    err = _rel(graph_logits, torch.cat(eager_logits, 1))
    _record(f"generation/{name}/{str(dtype).split('.')[-1]}/cuda_graph", err)
    assert err < 1e-3
    assert torch.equal(graph_tokens, torch.cat(eager_tokens, 1))

    dyn = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    dyn_logits = [dyn.logits]
    for i in range(new - 1):
        dyn_logits.append(model(input_ids=eager_tokens[i], cache=dyn.cache).logits)
    assert _rel(torch.cat(eager_logits, 1), torch.cat(dyn_logits, 1)) < TOL[dtype]

    # the graph stays bound to its cache: reset in place and a new prefill reuse it
    graph_cache.reset()
    prefill(graph_cache)
    again = decoder.step(eager_tokens[0]).clone()
    assert _rel(again, eager_logits[1]) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["mla", "mamba2", "mixed"])
@pytest.mark.parametrize("switch", ["graph_small_kernels", "graph_fuse_residual"])
@torch.no_grad()
def test_captured_step_with_a_kernel_switch_decodes_like_without_it(switch, name, dtype):
    """A captured step's runtime setting on against off, the others at their defaults: ``graph_small_kernels`` (the
    captured step's norms and SwiGLU through fla's kernels instead of the torch ops), ``graph_fuse_residual`` (each
    block's residual add in the next norm's kernel). Teacher-forced with the same tokens: logits to rounding, fp32
    tokens equal."""
    from hybridlm.model.cache import HybridCache
    model = _model(name, dtype)
    B, P, new = 3, 137, 12
    ids = _ids(B, P)
    forced = _ids(B, new - 1, seed=1)

    def decode(on):
        model.set_runtime(**{switch: on})
        cache = HybridCache(model.config, max_length=P + new - 1, batch_size=B, dtype=dtype, device=DEVICE)
        _, logits, _, decoder = greedy_decode(model, ids, new, cache, forced=forced)
        assert decoder.graph is not None
        return logits

    off, on = decode(False), decode(True)
    err = _rel(on, off)
    _record(f"generation/{name}/{str(dtype).split('.')[-1]}/{switch}", err)
    assert err < (1e-4 if dtype == torch.float32 else 3e-2)
    if dtype == torch.float32:
        assert torch.equal(on.argmax(-1), off.argmax(-1))


@pytest.mark.parametrize("name", ["mamba2", "mixed"])
@torch.no_grad()
def test_graphed_generate_equals_its_eager_run(name):
    """graphed_generate through the CUDA graph against the same call with cuda_graph=False (eager steps on the
    static cache), fp32: the same tokens, EOS handling included."""
    from hybridlm.model.graphs import graphed_generate
    model = _model(name, torch.float32)
    ids = _ids(3, 137)
    eager = graphed_generate(model, ids, 40, cuda_graph=False)
    graphed = graphed_generate(model, ids, 40)
    assert torch.equal(graphed, eager)
    eos = int(eager[1, 137 + 5])
    assert torch.equal(graphed_generate(model, ids, 40, eos_token_id=eos, pad_token_id=0),
                       graphed_generate(model, ids, 40, eos_token_id=eos, pad_token_id=0, cuda_graph=False))


@pytest.mark.parametrize("name", ["mamba2", "mixed"])
@torch.no_grad()
def test_generate_on_cuda_takes_the_graph_path_with_the_same_tokens(name):
    """On CUDA, plain model.generate() of full rows goes through graphed_generate (the captured step) and gives
    the tokens of transformers' own loop (fast_path=False), fp32 greedy, EOS included; a repeated call replays
    the captured step kept from the first."""
    model = _model(name, torch.float32)
    ids = _ids(3, 137)
    mask = torch.ones_like(ids)
    fast = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    slow = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                          fast_path=False)
    assert torch.equal(fast, slow)
    kept = model.__dict__["_kept_decoder"].decoder  # a second call of the shape replays the kept graph
    again = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert torch.equal(again, fast) and model.__dict__["_kept_decoder"].decoder is kept and kept.graph is not None
    eos = int(slow[1, 137 + 5])
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, fast_path=False, **kw))
