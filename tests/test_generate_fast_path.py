"""generate() through both paths, fp32: the static-cache fast path (``fast_path=True``: on a CPU it runs the
decision code CUDA's default runs, with a static cache and eager steps; on CUDA it replays a captured CUDA-graph
decode step) and transformers' own loop (``fast_path=False``). A call the fast path takes gives transformers'
tokens (greedy, and seeded sampling: the same top-k / temperature resolution, so the same draws) and leaves the
global random state the loop leaves; a call it cannot serve says why once and takes the loop.
Also: hidden states from forward and generate, prefill chunking with the default cache, and an export that carries
padding and greedy defaults to transformers' generate() and pipeline().

Device: the CPU by default; ``HYBRIDLM_TEST_DEVICE=cuda`` runs the same tests with the model, its inputs and the
generators on the current CUDA device (and fails at collection when CUDA is unavailable), comparing the CUDA
generator's state as well as the CPU one's (the fast path samples on the device's generator). benchmarks/acceptance.py
(part "generate") runs it so on a GPU host."""
import contextlib
import copy
import json
import logging
import os
import threading
import time
import warnings

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, CompileConfig, GenerationConfig, LogitsProcessorList,
                          pipeline)
from transformers.generation.logits_process import TemperatureLogitsWarper
from transformers.generation.streamers import BaseStreamer

from conftest import count_graphed_generate, rel_err, tiny_config
from hybridlm.model import HybridForCausalLM, fast_generate, modeling
from hybridlm.model.generate import greedy_generate, save_tokenizer, set_generation_defaults

LOGGER = "hybridlm.model.fast_generate"
P = 7  # prompt length

DEVICE = os.environ.get("HYBRIDLM_TEST_DEVICE") or "cpu"
if DEVICE not in ("cpu", "cuda"):
    pytest.fail(f"HYBRIDLM_TEST_DEVICE={DEVICE!r}: 'cpu' (the default) or 'cuda'", pytrace=False)
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.fail(f"HYBRIDLM_TEST_DEVICE=cuda, but CUDA is unavailable (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False)", pytrace=False)


def _rng_state() -> tuple:
    """The global random state generate() may draw from: the CPU generator's, and on CUDA the current device's."""
    cpu = torch.random.get_rng_state()
    return (cpu, torch.cuda.get_rng_state()) if DEVICE == "cuda" else (cpu,)


def _set_rng_state(state: tuple) -> None:
    torch.random.set_rng_state(state[0])
    if DEVICE == "cuda":
        torch.cuda.set_rng_state(state[1])


def _same_rng_state(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HybridForCausalLM(tiny_config("*-G-K-S-", mixer="gdn")).eval().to(DEVICE)


def _ids(B=2, T=P, seed=1):
    """[B, T] token ids on DEVICE, drawn on the CPU: the same ids on either device."""
    return torch.randint(1, 512, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _left_padded(pad=0):
    """Two rows, the first with 3 pads on the left; (ids, mask)."""
    ids = _ids()
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = pad, 0
    return ids, mask


@pytest.fixture
def both(model, monkeypatch, caplog):
    """``both(inputs, seed, **kw)`` -> (fast_path=True result, fast_path=False result, the fast path's
    graphed_generate arguments or None, what the fast path logged). Each call seeds the global RNG with ``seed``
    and gets its own copy of ``kw``; the global random state after the two calls must be the same."""
    calls = count_graphed_generate(monkeypatch)

    def run(inputs, seed=0, **kw):
        fast_generate._SAID.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            torch.manual_seed(seed)
            fast = model.generate(inputs, fast_path=True, **copy.deepcopy(kw))
        said = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        state = _rng_state()
        plan = calls[-1] if calls else None
        calls.clear()
        torch.manual_seed(seed)
        loop = model.generate(inputs, fast_path=False, **copy.deepcopy(kw))
        assert not calls
        assert _same_rng_state(state, _rng_state()), "the fast path left another random state than the loop"
        return fast, loop, plan, said
    return run


# name -> (generate arguments, what the fast path must have been given)
TAKEN = {
    "greedy": (dict(max_new_tokens=10, do_sample=False), dict(max_new_tokens=10, do_sample=False)),
    # no max_new_tokens: transformers' default max_length (20 new tokens)
    "bare": (dict(), dict(max_new_tokens=20, do_sample=False)),
    "max_length": (dict(max_length=P + 6), dict(max_new_tokens=6)),
    # sampling without top_k: transformers' default top-k (50)
    "sample": (dict(do_sample=True, max_new_tokens=12), dict(do_sample=True, top_k=50, temperature=1.0)),
    "sample_top_k_temperature": (dict(do_sample=True, top_k=5, temperature=0.7, max_new_tokens=12),
                                 dict(top_k=5, temperature=0.7)),
    "sample_top_k_off": (dict(do_sample=True, top_k=0, temperature=1.5, max_new_tokens=12),
                         dict(top_k=None, temperature=1.5)),
    "sample_top_k_none": (dict(do_sample=True, top_k=None, max_new_tokens=8), dict(top_k=None)),  # set: none
    "sample_top_p_one": (dict(do_sample=True, top_p=1.0, max_new_tokens=8), dict(top_k=50)),
    "generation_config": (dict(generation_config=GenerationConfig(do_sample=True, top_k=3, max_new_tokens=9)),
                          dict(top_k=3, max_new_tokens=9)),
    # greedy: transformers ignores the sampling settings
    "greedy_with_sampling_settings": (dict(do_sample=False, top_p=0.5, top_k=3, max_new_tokens=6),
                                      dict(do_sample=False)),
    "all_ones_mask": (dict(attention_mask=torch.ones(2, P, dtype=torch.long, device=DEVICE), pad_token_id=0,
                           max_new_tokens=8),
                      dict(pad_token_id=0)),
    # a pad id that is not in the rows: nothing to infer
    "pad_id_no_pads": (dict(pad_token_id=0, max_new_tokens=8), dict(pad_token_id=0)),
}


@pytest.mark.parametrize("seed", [3])
@pytest.mark.parametrize("case", TAKEN)
def test_fast_path_takes_the_call_and_gives_transformers_tokens(model, both, case, seed):
    kw, want = TAKEN[case]
    # transformers warns that the default length applies, on either path
    with pytest.warns(UserWarning, match="max_length") if case == "bare" else contextlib.nullcontext():
        fast, loop, plan, said = both(_ids(), seed=seed, **kw)
    assert plan is not None and not said, said
    for key, value in want.items():
        assert plan[key] == value, (key, plan)
    assert torch.equal(fast, loop)
    if not plan["do_sample"]:  # and the tokens of a plain loop of full forwards
        assert torch.equal(fast, greedy_generate(model, _ids(), fast.shape[1] - P))


@torch.no_grad()
def test_fast_path_eos_stopping_equals_the_loop(model, both):
    greedy = greedy_generate(model, _ids(), 12)
    eos = int(greedy[0, P + 2])  # row 0's third new token
    fast, loop, plan, said = both(_ids(), max_new_tokens=12, eos_token_id=eos)
    assert plan is not None and plan["eos_token_id"] == eos and plan["pad_token_id"] == eos and not said
    assert torch.equal(fast, loop) and (fast[0, P + 3:] == eos).all()
    fast, loop, plan, said = both(_ids(), max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert plan is not None and torch.equal(fast, loop) and (fast[0, P + 3:] == 0).all()
    fast, loop, plan, said = both(_ids(), seed=5, do_sample=True, top_k=2, max_new_tokens=12, eos_token_id=eos)
    assert plan is not None and torch.equal(fast, loop)


@torch.no_grad()
def test_fast_path_seeded_sampling_draws_what_the_loop_draws(model, both):
    """Several seeds, with and without top-k: equal tokens, and different seeds give different tokens."""
    seen = []
    for seed in range(4):
        for kw in (dict(), dict(top_k=20, temperature=0.9)):
            fast, loop, plan, _ = both(_ids(), seed=seed, do_sample=True, max_new_tokens=10, **kw)
            assert plan is not None and torch.equal(fast, loop), (seed, kw)
            seen.append(fast)
    assert len({tuple(t.flatten().tolist()) for t in seen}) > 1


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value.clone())

    def end(self):
        self.ended = True


# name -> (inputs or None for _ids(), generate arguments, the reason the fast path gives)
FALLBACK = {
    "left_padded_batch": (_left_padded()[0], dict(attention_mask=_left_padded()[1], pad_token_id=0,
                                                  max_new_tokens=6), "padded rows (attention_mask has zeros)"),
    # padded rows and pad_token_id, no attention_mask: transformers infers the mask
    "padded_without_mask": (_left_padded()[0], dict(pad_token_id=0, max_new_tokens=6),
                            "attention_mask inferred from pad_token_id=0"),
    "top_p": (None, dict(do_sample=True, top_p=0.8, max_new_tokens=6), "TopPLogitsWarper"),
    "min_p": (None, dict(do_sample=True, min_p=0.1, max_new_tokens=6), "MinPLogitsWarper"),
    "beams": (None, dict(num_beams=2, max_new_tokens=5), "beam_search"),
    "beam_sample": (None, dict(num_beams=2, do_sample=True, max_new_tokens=5), "beam_sample"),
    "repetition_penalty": (None, dict(repetition_penalty=1.5, max_new_tokens=6), "RepetitionPenaltyLogitsProcessor"),
    "no_repeat_ngram_size": (None, dict(no_repeat_ngram_size=2, max_new_tokens=8), "NoRepeatNGramLogitsProcessor"),
    "min_new_tokens": (None, dict(min_new_tokens=4, eos_token_id=5, max_new_tokens=6),
                       "MinLengthLogitsProcessor"),
    "suppress_tokens": (None, dict(suppress_tokens=[1, 2], max_new_tokens=6), "SuppressTokensLogitsProcessor"),
    "several_eos": (None, dict(eos_token_id=[5, 6], max_new_tokens=6), "several EOS ids [5, 6]"),
    "num_return_sequences": (None, dict(do_sample=True, num_return_sequences=2, max_new_tokens=4),
                             "num_return_sequences=2"),
    "output_scores": (None, dict(output_scores=True, return_dict_in_generate=True, max_new_tokens=5),
                      "output_scores=True"),
    "output_logits": (None, dict(output_logits=True, return_dict_in_generate=True, max_new_tokens=5),
                      "output_logits=True"),
    "return_dict": (None, dict(return_dict_in_generate=True, max_new_tokens=5), "return_dict_in_generate=True"),
    "output_hidden_states": (None, dict(output_hidden_states=True, return_dict_in_generate=True, max_new_tokens=4),
                             "output_hidden_states"),
    "prefill_chunk_size": (None, dict(prefill_chunk_size=3, max_new_tokens=5), "prefill_chunk_size=3"),
    "use_cache_false": (None, dict(use_cache=False, max_new_tokens=4), "use_cache=False"),
    "max_time": (None, dict(max_time=600.0, max_new_tokens=4), "MaxTimeCriteria"),
    "logits_processor": (None, dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]),
                                    max_new_tokens=4), "argument 'logits_processor'"),
    "bad_words_ids": (None, dict(bad_words_ids=[[3], [4, 5]], max_new_tokens=4), "NoBadWordsLogitsProcessor"),
    "typical_p": (None, dict(do_sample=True, typical_p=0.9, max_new_tokens=4), "TypicalLogitsWarper"),
    "renormalize_logits": (None, dict(do_sample=True, renormalize_logits=True, max_new_tokens=4),
                           "LogitNormalization"),
    "forced_eos_token_id": (None, dict(forced_eos_token_id=3, max_new_tokens=4), "ForcedEOSTokenLogitsProcessor"),
    "cache_implementation": (None, dict(cache_implementation="dynamic", max_new_tokens=4),
                             "cache_implementation='dynamic'"),
    "position_ids": (None, dict(position_ids=torch.arange(P, device=DEVICE).expand(2, P), max_new_tokens=4),
                     "argument 'position_ids'"),
}


@pytest.mark.parametrize("case", FALLBACK)
@torch.no_grad()
def test_fast_path_says_why_and_takes_the_loop(model, both, case):
    inputs, kw, reason = FALLBACK[case]
    inputs = _ids() if inputs is None else inputs
    fast, loop, plan, said = both(inputs, seed=7, **kw)
    assert plan is None and len(said) == 1 and reason in said[0], said
    if isinstance(loop, torch.Tensor):
        assert torch.equal(fast, loop)
        return
    assert torch.equal(fast.sequences, loop.sequences)
    for field in ("scores", "logits"):
        a, b = getattr(fast, field), getattr(loop, field)
        assert (a is None) == (b is None) and (a is None or all(torch.equal(x, y) for x, y in zip(a, b)))
    if kw.get("output_hidden_states"):
        assert len(fast.hidden_states) == fast.sequences.shape[1] - P
        for step, (a, b) in enumerate(zip(fast.hidden_states, loop.hidden_states)):
            assert len(a) == model.config.num_hidden_layers + 1
            assert all(x.shape == (2, P if step == 0 else 1, model.config.hidden_size) for x in a)
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@torch.no_grad()
def test_padded_rows_generate_what_each_row_generates_alone(model, both):
    """Left padding, with the mask given or inferred from pad_token_id: each row's tokens are its own."""
    ids, mask = _left_padded()
    for kw in (dict(attention_mask=mask), dict()):
        fast, loop, plan, said = both(ids, pad_token_id=0, max_new_tokens=6, **kw)
        assert torch.equal(fast[0, 3:], greedy_generate(model, ids[:1, 3:], 6)[0]), kw  # pads are not tokens
        assert torch.equal(fast[1], greedy_generate(model, ids[1:], 6)[0]), kw
        assert plan is None and torch.equal(fast, loop)


@torch.no_grad()
def test_output_logits_and_scores_are_those_of_full_forwards(model, both):
    fast, loop, _, _ = both(_ids(), output_logits=True, output_scores=True, return_dict_in_generate=True,
                            max_new_tokens=5)
    full = model(input_ids=fast.sequences).logits
    for i, (logits, scores) in enumerate(zip(fast.logits, fast.scores)):
        assert rel_err(logits, full[:, P - 1 + i]) < 1e-4 and torch.equal(scores, logits)  # greedy: no processors


@torch.no_grad()
def test_streamer_gets_the_loops_tokens(model, both):
    streams = []
    for fast_path in (True, False):
        streamer = Collect()
        fast_generate._SAID.clear()
        out = model.generate(_ids(), max_new_tokens=5, streamer=streamer, fast_path=fast_path)
        streamed = torch.cat([t.reshape(2, -1) for t in streamer.tokens], 1)  # transformers streams CPU tensors
        assert streamer.ended and torch.equal(streamed.to(out.device), out)
        streams.append(out)
    assert torch.equal(*streams) and torch.equal(streams[0], greedy_generate(model, _ids(), 5))
    fast, loop, plan, said = both(_ids(), max_new_tokens=5, streamer=Collect())
    assert plan is None and "argument 'streamer'" in said[0]


@torch.no_grad()
def test_continuing_from_a_returned_cache(model, both):
    first = model.generate(_ids(), max_new_tokens=4, return_dict_in_generate=True, fast_path=False)
    cache = first.cache if hasattr(first, "cache") else first.past_key_values
    more = torch.cat([first.sequences, _ids(2, 3, seed=9)], 1)
    fast, loop, plan, said = both(more, max_new_tokens=5, **{modeling._CACHE_FIELD: cache})
    assert plan is None and len(said) == 1 and "argument" in said[0], said
    assert torch.equal(fast, loop) and torch.equal(fast, greedy_generate(model, more, 5))


@torch.no_grad()
def test_prefill_chunking_with_the_default_cache(model):
    want = greedy_generate(model, _ids(2, 11), 5)
    for chunk in (1, 3, 4):
        assert torch.equal(model.generate(_ids(2, 11), max_new_tokens=5, prefill_chunk_size=chunk), want)


@torch.no_grad()
def test_forward_hidden_states_and_attentions(model):
    ids = _ids()
    out = model(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    assert isinstance(hs, tuple) and len(hs) == model.config.num_hidden_layers + 1
    assert all(h.shape == (2, P, model.config.hidden_size) for h in hs)
    assert torch.equal(hs[0], model.model.embed_tokens(ids))
    assert torch.equal(hs[-1], model.model(input_ids=ids))  # the last one after the final norm
    x = hs[0]
    for i, block in enumerate(model.model.layers[:-1]):
        x = block(x)
        assert torch.equal(hs[i + 1], x)
    assert torch.equal(out.logits, model.lm_head(hs[-1]).float())
    assert model(input_ids=ids).hidden_states is None
    cached = model(input_ids=ids, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    assert cached.logits.shape[1] == 1
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cached.hidden_states, hs))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.config, "output_hidden_states", True)
        assert len(model(input_ids=ids).hidden_states) == model.config.num_hidden_layers + 1
    with pytest.raises(NotImplementedError, match="attention weights"):
        model(input_ids=ids, output_attentions=True)
    with pytest.raises(NotImplementedError, match="attention weights"):
        model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)


@torch.no_grad()
def test_bf16_greedy_equal_on_both_paths(both, model):
    bf = copy.deepcopy(model).to(torch.bfloat16)
    fast = bf.generate(_ids(), max_new_tokens=8, fast_path=True)
    loop = bf.generate(_ids(), max_new_tokens=8, fast_path=False)
    assert torch.equal(fast, loop)


# ------------------------------------------------------------------------------------------ export

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny model of the real tokenizer's vocabulary, exported as pretrain / upcycle export it."""
    from hybridlm.data import load_tokenizer
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config("*-G-", mixer="gdn", vocab_size=len(tok),
                                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)).eval()
    out = tmp_path_factory.mktemp("export")
    set_generation_defaults(model, tok)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    return out, tok


def test_export_carries_padding_and_greedy_defaults(exported):
    out, tok = exported
    assert tok.padding_side == "right"  # the caller's tokenizer is left as it was
    config = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert config["pad_token_id"] == tok.pad_token_id == gen["pad_token_id"] != tok.eos_token_id
    assert gen["eos_token_id"] == tok.eos_token_id and gen["bos_token_id"] == tok.bos_token_id
    assert gen["do_sample"] is False
    assert json.loads((out / "tokenizer_config.json").read_text())["padding_side"] == "left"
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.padding_side == "left" and loaded.pad_token_id == tok.pad_token_id


@torch.no_grad()
def test_exported_model_generates_left_padded_batches(exported):
    out, _ = exported
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval().to(DEVICE)
    prompts = ["It is a truth universally acknowledged", "Emma"]
    batch = tok(prompts, return_tensors="pt", padding=True).to(DEVICE)
    assert (batch["attention_mask"][:, -1] == 1).all()  # padded on the left
    for fast_path in (True, False):
        for kw in (dict(attention_mask=batch["attention_mask"]), dict()):  # the mask given, or inferred
            got = model.generate(batch["input_ids"], max_new_tokens=4, fast_path=fast_path, **kw)
            for i, text in enumerate(prompts):
                alone = tok(text, return_tensors="pt")["input_ids"].to(DEVICE)
                n = alone.shape[1]
                assert torch.equal(got[i, -(n + 4):], greedy_generate(model, alone, 4)[0]), (fast_path, kw, i)


@torch.no_grad()
def test_exported_model_pipeline_is_greedy(exported):
    out, _ = exported
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval().to(DEVICE)
    prompts = ["It is a truth universally acknowledged", "Emma"]
    generator = pipeline("text-generation", model=model, tokenizer=tok, device=model.device)
    texts = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        texts.append(generator(prompts[1], max_new_tokens=5, return_full_text=False)[0]["generated_text"])
    alone = tok(prompts[1], return_tensors="pt")["input_ids"].to(DEVICE)
    assert texts[0] == texts[1] == tok.decode(greedy_generate(model, alone, 5)[0, alone.shape[1]:])


# ------------------------------------------------------------------------------------- random state and warnings

def _first_eos(new, eos):
    """[B, n] new tokens -> the step (from 1) of each row's first ``eos``, or None."""
    return [int((row == eos).int().argmax()) + 1 if (row == eos).any() else None for row in new]


def _eos_finishing(new, lo, hi, all_rows=True):
    """A token of every row of ``new`` (``all_rows``; else of row 0 and of no other) whose rows reach it first at
    different steps, the last of them in (lo, hi]; None if there is none."""
    for eos in sorted(set(new[0].tolist())):
        steps = _first_eos(new, eos)
        if all_rows and None not in steps and len(set(steps)) == len(steps) and lo < max(steps) <= hi:
            return eos
        if not all_rows and steps[1:] == [None] * (len(steps) - 1) and lo < steps[0] <= hi:
            return eos
    return None


# (name, rows, generate arguments, the (lo, hi] the last finishing row's EOS step is picked in (None: an EOS never
# drawn), whether every row finishes)
SAMPLED_CALLS = [
    ("one row, EOS at step 1 to 3", 1, dict(top_k=3), (0, 3), True),
    ("two rows, EOS at different steps before step 32", 2, dict(top_k=3), (3, 31), True),
    ("greedy, two rows finishing", 2, dict(do_sample=False), (0, 39), True),
    ("one row, EOS after step 32", 1, dict(), (32, 39), True),
    ("two rows, one never finishes: max_new_tokens stops it", 2, dict(top_k=3, pad_token_id=0), (0, 39), False),
    ("two rows, EOS at different steps after step 32", 2, dict(top_k=3, temperature=0.8), (32, 39), True),
    ("one row, no EOS in 40 steps", 1, dict(top_k=3), None, True),
]


@torch.no_grad()
def test_seeded_sampling_calls_leave_the_random_state_the_loop_leaves(model, monkeypatch):
    """Seeded once, then several sampled calls with an EOS that stops them at various steps: each call's tokens,
    and the global random state after it, are the loop's (the fast path draws past the last EOS until its next look
    at the rows, then rewinds to the loop's draw count). Each call's EOS is picked from its own draws: a probe run of
    the loop from the same random state, the state restored."""
    calls = count_graphed_generate(monkeypatch)
    new_tokens = 40
    plans, steps = [], []
    torch.manual_seed(0)
    loop = []
    for name, rows, kw, window, all_rows in SAMPLED_CALLS:
        kw = {"do_sample": True, "max_new_tokens": new_tokens, **kw}
        state = _rng_state()
        probe = model.generate(_ids(rows), fast_path=False, **kw)[:, P:]
        _set_rng_state(state)
        if window is None:
            kw["eos_token_id"] = next(t for t in range(512) if t not in probe)
        else:
            kw["eos_token_id"] = _eos_finishing(probe, *window, all_rows=all_rows)
            assert kw["eos_token_id"] is not None, f"{name}: no such EOS in the draws {probe.tolist()}"
        plans.append(kw)
        out = model.generate(_ids(rows), fast_path=False, **kw)
        loop.append((out, _rng_state()))
        steps.append(_first_eos(out[:, P:], kw["eos_token_id"]))
    assert not calls
    torch.manual_seed(0)
    for (name, *_), kw, (want, state), first in zip(SAMPLED_CALLS, plans, loop, steps):
        got = model.generate(_ids(want.shape[0]), fast_path=True, **kw)
        assert calls.pop()["do_sample"] == kw["do_sample"]
        assert torch.equal(got, want), name
        assert _same_rng_state(_rng_state(), state), (name, first, got.shape[1] - P)
    # what the calls covered: rows finishing at different steps, stops on both sides of step 32's look, and stops
    # by max_new_tokens with and without a finished row
    lengths = [out.shape[1] - P for out, _ in loop]
    assert lengths[0] <= 3 and 3 < lengths[1] <= 31 and 32 < lengths[3] < new_tokens, lengths
    assert len(set(steps[1])) == 2 and len(set(steps[5])) == 2 and 32 < lengths[5] < new_tokens, steps
    assert lengths[4] == lengths[6] == new_tokens and steps[4][0] < new_tokens and steps[6] == [None], steps



@torch.no_grad()
def test_graphed_generate_rewinds_the_generator_it_is_given(model):
    """A generator passed to graphed_generate (on DEVICE) is left where the loop leaves DEVICE's global one, seeded
    alike; the global random state is not touched."""
    from hybridlm.model.graphs import graphed_generate
    torch.manual_seed(4)
    probe = model.generate(_ids(1), fast_path=False, do_sample=True, top_k=3, max_new_tokens=40)[0, P:].tolist()
    # a token first drawn at step 5, 6 or 7: the fast path draws on to its look after step 8, then rewinds
    stop = next(step for step in (5, 6, 7) if probe.index(probe[step - 1]) == step - 1)
    eos = probe[stop - 1]
    torch.manual_seed(4)
    want = model.generate(_ids(1), fast_path=False, do_sample=True, top_k=3, max_new_tokens=40, eos_token_id=eos)
    state = _rng_state()
    generator = torch.Generator(device=DEVICE).manual_seed(4)
    got = graphed_generate(model, _ids(1), 40, eos_token_id=eos, do_sample=True, top_k=3, generator=generator)
    assert torch.equal(got, want) and want.shape[1] == P + stop
    assert _same_rng_state(_rng_state(), state)
    assert torch.equal(generator.get_state(), state[-1])  # DEVICE's global generator: the CPU's or CUDA's

def _said_by_transformers(caplog, monkeypatch, run):
    """(transformers' log records, Python warnings) while ``run()`` runs: (logger, level, text) and (category, text,
    file, line)."""
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    caplog.clear()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    records = {id(r): r for r in caplog.records}.values()  # one record reaches caplog's handler twice when pytest's
    # handlers sit on transformers' logger too
    said = [(r.name, r.levelname, r.getMessage()) for r in records if r.name.startswith("transformers")]
    return said, [(w.category, str(w.message), w.filename, w.lineno) for w in caught]


NO_MASK = "The attention mask is not set with a batched input, and cannot be inferred"
NO_MASK_NO_PAD = "The attention mask and the pad token id were not set, with a batched input"
RIGHT_PADDING = "right-padding was detected"
COMPILE_SKIPPED = "Compilation will be skipped"


def _padded_with(pad, right=False):
    ids = _ids()
    if right:
        ids[0, -2:] = pad
    else:
        ids[0, :3] = pad
    return ids


# name -> (inputs, generate arguments, whether the fast path takes it, a text transformers says)
SAID = {
    # a batch padded with its EOS, no mask: transformers cannot infer the mask, and says so (once a process)
    "padded_with_eos_no_mask": (_padded_with(9), dict(eos_token_id=9, pad_token_id=9, max_new_tokens=4), True,
                                NO_MASK),
    "padded_with_eos_no_mask_sampled": (_padded_with(9), dict(eos_token_id=9, pad_token_id=9, do_sample=True,
                                                              max_new_tokens=4), True, NO_MASK),
    "right_padded_with_eos_no_mask": (_padded_with(9, right=True), dict(eos_token_id=9, pad_token_id=9,
                                                                         max_new_tokens=4), True, RIGHT_PADDING),
    "eos_no_pad_no_mask": (_ids(), dict(eos_token_id=9, max_new_tokens=4), True, NO_MASK_NO_PAD),
    "all_ones_mask": (_ids(), dict(attention_mask=torch.ones(2, P, dtype=torch.long, device=DEVICE),
                                   eos_token_id=9, max_new_tokens=4), True, None),
    # a mask transformers infers from the pad id: the loop, which says nothing about it
    "padded_no_mask": (_padded_with(0), dict(pad_token_id=0, max_new_tokens=4), False, None),
    # the loop's own warnings, said once and not also by the fast path's look at the call
    "default_length_top_p": (_ids(), dict(do_sample=True, top_p=0.5), False, "max_length"),
    "negative_eos": (_ids(), dict(eos_token_id=-1, max_new_tokens=3), False, "should consist of positive"),
    "greedy_with_temperature": (_ids(), dict(do_sample=False, temperature=0.5, max_new_tokens=3), True,
                                "not valid and may be ignored"),
    "default_length": (_ids(), dict(), True, "max_length"),
    # nothing compiles a HybridCache's forward: transformers says once that compilation is skipped
    "compile_config": (_ids(), dict(compile_config=CompileConfig(), max_new_tokens=4), True, COMPILE_SKIPPED),
}


@pytest.mark.parametrize("case", SAID)
@torch.no_grad()
def test_transformers_says_on_the_fast_path_what_it_says_on_the_loop(model, monkeypatch, caplog, case):
    """Two calls in a row on each path, transformers' once-only memory cleared before each pair: the same log
    records (text, logger, level, count) and warnings (text, category, location)."""
    inputs, kw, taken, text = SAID[case]
    calls = count_graphed_generate(monkeypatch)
    said = {}
    for fast_path in (True, False):
        logging.Logger.warning_once.cache_clear()
        fast_generate._SAID.clear()

        def run():
            for _ in range(2):
                torch.manual_seed(0)
                model.generate(inputs, fast_path=fast_path, **copy.deepcopy(kw))
        said[fast_path] = _said_by_transformers(caplog, monkeypatch, run)
        assert len(calls) == (2 * taken if fast_path else 0), case
        calls.clear()
    assert said[True] == said[False]
    logs, caught = said[False]
    if text is not None:
        assert any(text in entry[2] for entry in logs) or any(text in entry[1] for entry in caught), said[False]
    if text in (NO_MASK, COMPILE_SKIPPED):  # warning_once: once for both calls
        assert sum(text in entry[2] for entry in logs) == 1, logs


def test_held_back_holds_this_threads_transformers_messages_only():
    """What transformers says inside the block (log records, once-only records, Python warnings) is said by say(),
    in order, a warning with the location it was raised at; other loggers', other modules' and other threads'
    messages pass; the wrapped methods are restored after the block."""
    handle, warn = logging.Logger.handle, warnings.warn
    ours, theirs = logging.getLogger("transformers.generation.utils"), logging.getLogger("elsewhere")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    keep = Keep()
    logging.Logger.warning_once.cache_clear()
    for logger in (ours, theirs):
        logger.addHandler(keep)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fast_generate.HeldBack() as held:
                ours.warning("first")
                theirs.warning("passes")
                other = threading.Thread(target=lambda: ours.warning("other thread"))
                other.start()
                other.join()
                ours.warning_once("second")
                exec("import warnings\nwarnings.warn('third')", {"__name__": "transformers.elsewhere"})
                warnings.warn("passes too")
                assert records == ["passes", "other thread"] and [str(w.message) for w in caught] == ["passes too"]
            held.say()
            assert records == ["passes", "other thread", "first", "second"]
            assert [(str(w.message), w.filename) for w in caught[1:]] == [("third", "<string>")]
    finally:
        for logger in (ours, theirs):
            logger.removeHandler(keep)
    assert logging.Logger.handle is handle and warnings.warn is warn


# ------------------------------------------------------------------------------------------ real clients

def _said_why(caplog, run):
    """(run()'s result, what the fast path logged while it ran), the once-per-reason memory cleared first."""
    fast_generate._SAID.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = run()
    return out, [r.getMessage() for r in caplog.records if r.name == LOGGER]


# (rows, prompt length, new tokens): the shapes the threads mix
THREAD_CALLS = [(2, P, 24), (1, 5, 12), (3, P, 24), (2, 9, 16)]


@torch.no_grad()
def test_concurrent_calls_each_give_the_call_made_alone(model, monkeypatch, caplog):
    """One model shared by 4 threads x 3 greedy calls of mixed shapes (a web app's request threads): every result
    is the call's own, made alone. A call that finds the kept static cache in use takes transformers' loop and says
    so once: shown by a call made while the cache is held."""
    calls = count_graphed_generate(monkeypatch)

    def call(k):
        B, T, new = THREAD_CALLS[k % len(THREAD_CALLS)]
        ids = _ids(B, T, seed=k % len(THREAD_CALLS))
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, fast_path=True)
    alone = [call(k) for k in range(len(THREAD_CALLS))]
    assert len(calls) == len(THREAD_CALLS)
    assert all(torch.equal(a, model.generate(_ids(B, T, seed=k), max_new_tokens=new, fast_path=False))
               for k, (a, (B, T, new)) in enumerate(zip(alone, THREAD_CALLS)))
    calls.clear()
    results, errors = {}, []
    start = threading.Barrier(4)

    def worker(w):
        try:
            start.wait()
            for j in range(3):
                results[(w, j)] = call(w + j)
        except Exception as e:  # noqa: BLE001 - reported below with the thread's call
            errors.append((w, repr(e)))
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 12 and calls, "no call took the fast path"
    for (w, j), out in results.items():
        assert torch.equal(out, alone[(w + j) % len(THREAD_CALLS)]), (w, j)
    # a call while another holds the kept cache: the loop, the reason said
    kept = model.__dict__["_kept_decoder"]
    calls.clear()
    with kept.lock:
        out, said = _said_why(caplog, lambda: call(0))
    assert not calls and torch.equal(out, alone[0])
    assert len(said) == 1 and fast_generate.BUSY in said[0], said


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_seeded_sampling_draws_the_loops_tokens(model, monkeypatch, caplog, dtype):
    """A half-precision model, a batch of two 6-token prompts, 20 seeds of temperature 1.5 without top-k (where a
    last-bit difference in the logits moves draws): the fast path's tokens and random state are the loop's. On a
    CPU its eager static-cache step computes what the loop's step computes; on CUDA, whose captured step does not,
    sampling in half precision takes the loop and says why."""
    torch.manual_seed(0)  # init std 0.3: logits spread as a trained model's (std ~2.4); the default init's near-uniform
    # draws hide last-bit differences (the whole-buffer attention of a captured step moved 5 of 20 seeds in bf16)
    half = HybridForCausalLM(tiny_config("*-G-K-S-", mixer="gdn", initializer_range=0.3)).eval().to(DEVICE, dtype)
    calls = count_graphed_generate(monkeypatch)
    ids = _ids(2, 6, seed=3)
    kw = dict(do_sample=True, temperature=1.5, top_k=0, max_new_tokens=16)
    for seed in range(20):
        torch.manual_seed(seed)
        fast, said = _said_why(caplog, lambda: half.generate(ids, fast_path=True, **kw))
        state = _rng_state()
        torch.manual_seed(seed)
        loop = half.generate(ids, fast_path=False, **kw)
        assert torch.equal(fast, loop), seed
        assert _same_rng_state(state, _rng_state()), seed
        if DEVICE == "cpu":
            assert len(calls) == seed + 1 and not said, said
        else:
            assert not calls and len(said) == 1 and f"sampling in {dtype} on CUDA" in said[0], said
    greedy = half.generate(ids, fast_path=True, max_new_tokens=8)  # greedy keeps the fast path on either device
    assert len(calls) == (21 if DEVICE == "cpu" else 1) and torch.equal(greedy, half.generate(ids, max_new_tokens=8,
                                                                                              fast_path=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@torch.no_grad()
def test_static_cache_eager_step_is_the_dynamic_caches_step(dtype):
    """Every sublayer kind, each decode step's logits on a static cache (eager, as the fast path runs on a CPU)
    equal, bit for bit, the dynamic cache's under transformers' all-ones mask (the same operations in the same
    order); inside FIXED_SHAPES (a captured step's shapes: MLA over the whole buffer under a mask) they agree to
    rounding, and what unwritten slots hold never reaches them."""
    from hybridlm.model.cache import FIXED_SHAPES, HybridCache
    torch.manual_seed(0)
    m = HybridForCausalLM(tiny_config("*-G-K-S-", mixer="mamba2")).eval().to(DEVICE, dtype)
    ids = _ids(2, 5)
    dyn = HybridCache(m.config)
    static = HybridCache(m.config, max_length=5 + 12, batch_size=2, dtype=dtype, device=DEVICE)
    fixed = HybridCache(m.config, max_length=5 + 12, batch_size=2, dtype=dtype, device=DEVICE)
    for layer in fixed.layers:  # unwritten slots: garbage, which any leak through the mask would show
        if getattr(layer, "kv", None) is not None:
            layer.kv.fill_(1e3)
    a = m(input_ids=ids, cache=dyn, logits_to_keep=1).logits
    assert torch.equal(a, m(input_ids=ids, cache=static, logits_to_keep=1).logits)
    m(input_ids=ids, cache=fixed, logits_to_keep=1)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-1, torch.float16: 2e-2}[dtype]
    for step in range(10):
        nxt = a[:, -1].argmax(-1, keepdim=True)
        a = m(input_ids=nxt, cache=dyn, attention_mask=torch.ones(2, 6 + step, dtype=torch.long, device=DEVICE)).logits
        assert torch.equal(a, m(input_ids=nxt, cache=static).logits), step
        with FIXED_SHAPES.on():
            b = m(input_ids=nxt, cache=fixed).logits
        assert (a - b).abs().max().item() < tol, step


@torch.no_grad()
def test_huge_budget_with_an_early_eos_costs_what_is_generated(model, monkeypatch):
    """max_new_tokens=10**10 and an EOS at step 2: the loop's tokens, in a static cache of the prompt and
    CACHE_STEP new tokens, in well under a second. A call that outgrows its cache continues in longer ones (the
    loop's tokens, greedy and sampled) and the next call of the shape reuses the last one."""
    from hybridlm.model import graphs
    calls = count_graphed_generate(monkeypatch)
    ids = _ids(2, P)
    eos = int(model.generate(ids, max_new_tokens=3, fast_path=False)[0, P + 1])  # row 0's second new token
    kw = dict(max_new_tokens=10 ** 10, eos_token_id=eos, pad_token_id=0)
    loop = model.generate(ids[:1], fast_path=False, **kw)
    t0 = time.perf_counter()
    fast = model.generate(ids[:1], fast_path=True, **kw)
    took = time.perf_counter() - t0
    assert calls and torch.equal(fast, loop) and fast.shape[1] == P + 2
    assert model.__dict__["_kept_decoder"].decoder.cache.max_length == P + graphs.CACHE_STEP
    assert took < 5.0, took  # the old full-budget buffer failed to allocate (1.9 TB)

    monkeypatch.setattr(graphs, "CACHE_STEP", 8)
    new = 40  # need P + 39 positions: caches of P + 8, 2 (P + 8), then P + 39
    for kw in (dict(), dict(do_sample=True, top_k=20)):
        torch.manual_seed(1)
        loop = model.generate(ids, max_new_tokens=new, fast_path=False, **kw)
        state = _rng_state()
        torch.manual_seed(1)
        fast = model.generate(ids, max_new_tokens=new, fast_path=True, **kw)
        assert torch.equal(fast, loop) and _same_rng_state(state, _rng_state()), kw
        kept = model.__dict__["_kept_decoder"].decoder
        assert kept.cache.max_length == P + new - 1, kw
    torch.manual_seed(1)
    assert torch.equal(model.generate(ids, max_new_tokens=new, fast_path=True, **kw), loop)
    assert model.__dict__["_kept_decoder"].decoder is kept  # a call it fits reuses it


@torch.no_grad()
def test_forward_hooks_see_the_loops_model_calls(model, caplog):
    """A forward hook on the model or a module of it (or a global one): the fast path declines, so the hooks see
    the loop's model calls (an EOS at step 3 of 40: 3 calls, not the fast path's run to its next look, step 4)."""
    ids = _ids(1, seed=3)
    new = model.generate(ids, max_new_tokens=8, fast_path=False)[0, P:].tolist()
    # a token first drawn at step 3, 5, 6 or 7: between the fast path's looks (after steps 1, 2, 4, 8)
    steps = [step for step in (3, 5, 6, 7) if new.index(new[step - 1]) == step - 1]
    assert steps, new
    eos, stop = new[steps[0] - 1], steps[0]
    seen = []
    for register in (model.register_forward_hook, model.model.layers[2].mixer.register_forward_pre_hook,
                     torch.nn.modules.module.register_module_forward_hook):
        counts = {}
        hook = register(lambda module, *args: counts.__setitem__(module, counts.get(module, 0) + 1))
        try:
            for fast_path in (False, True):
                counts.clear()
                out, said = _said_why(caplog, lambda: model.generate(ids, max_new_tokens=40, eos_token_id=eos,
                                                                     fast_path=fast_path))
                seen.append((dict(counts), out))
                if fast_path:
                    assert len(said) == 1 and fast_generate.HOOKED in said[0], said
        finally:
            hook.remove()
        (loop_counts, loop), (fast_counts, fast) = seen[-2:]
        assert torch.equal(fast, loop) and fast.shape[1] == P + stop
        assert fast_counts == loop_counts and loop_counts, (fast_counts, loop_counts)
    assert max(seen[0][0].values()) == stop  # the model itself: a prefill and stop - 1 decode steps
    out, said = _said_why(caplog, lambda: model.generate(ids, max_new_tokens=4, fast_path=True))
    assert not said  # hooks removed: the fast path again
