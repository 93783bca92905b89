"""Generation throughput and memory of an upcycled hybrid against its Llama teacher (BENCHMARKS.md, "Generation throughput").

    python -m benchmarks.harness.generation --hybrid DIR --teacher DIR_OR_ASSET --out DIR \\
        [--prompt-lens 1024 8192] [--new-tokens 1024] [--batches 1 8 16 32 48 64 96 128] \\
        [--dtype bf16] [--repeats 1] [--warmup-steps 4] [--models hybrid teacher] [--check-generate N] \\
        [--cuda-graph]   # hybrid: static HybridCache + CUDA-graph-replayed decode steps
    python -m benchmarks.harness.generation --merge A.json B.json --out DIR   # join runs, redraw

**Models.** The hybrid is loaded with ``HybridForCausalLM.from_pretrained`` (its own backend: fla's Triton
kernels on CUDA) and decodes with its :class:`~hybridlm.model.cache.HybridCache` (MLA layers cache the latent
+ RoPE key only, mixers a constant recurrent + conv state). The teacher is loaded by
:func:`hybridlm.teacher.load_teacher` (transformers ``LlamaForCausalLM``, ``sdpa`` attention) and decodes with
transformers' default ``DynamicCache``. Both run in ``--dtype`` (bf16 by default on CUDA, fp32 on CPU).
The models are measured one after the other; only one is on the device at a time.

**Decoding.** Both go through the same explicit greedy loop (:func:`greedy_decode`), not ``generate()``:
one prefill forward over the prompt (``use_cache=True``, ``logits_to_keep=1``: only the last position's
logits), then ``new_tokens - 1`` single-token forwards carrying the cache, each followed by an ``argmax``;
no attention mask (no padding: the prompts are full rows) and no stopping criterion, so exactly
``new_tokens`` tokens are produced whatever the model predicts (EOS included) and both models do the same
work. ``generate()`` would add its per-step logits processors, stopping checks (a host sync each step) and
mask bookkeeping (an all-ones attention mask costs the hybrid a host sync per step to find there is no
padding), which differ between the two models' code paths; the explicit loop keeps the timing to the
models' own forwards. The loop is checked to produce exactly ``model.generate(do_sample=False)``'s tokens
and those of uncached full forwards (``tests/test_bench_generation.py``); on GPU ``--check-generate N``
records, at the smallest batch of each model and prompt length, for how many leading tokens the loop agrees
with ``generate`` (``generate_agree_tokens``, ``matches_generate``) and with full forwards
(``full_forward_agree_tokens``; in bf16 those may drift after a while: other kernels). Nothing in the
timed loop syncs with the host: the generated ids stay on the device.

**Prompts.** Random token ids, seeded (``--seed``), uniform over the model's vocabulary: the content does not
change the amount of work, only the prompt length does.

**Per entry** (model, prompt length P, batch B), after an untimed warm-up of the same shape (prefill plus
``--warmup-steps`` decode steps: Triton autotuning, cuBLAS handles), ``--repeats`` timed runs (medians):

* ``prefill_s``: the prompt forward and the first token's argmax (``torch.cuda.synchronize`` around it);
* ``decode_s``: the ``new_tokens - 1`` further steps; ``decode_tokens_per_s = B * (new_tokens - 1) / decode_s``
  (the tokens the decode steps produce; the first token comes from the prefill), ``decode_ms_per_step``;
* ``e2e_tokens_per_s = B * new_tokens / (prefill_s + decode_s)``: generation throughput, prompt included;
* ``peak_gib``: ``torch.cuda.max_memory_allocated`` over the run (peak stats reset before it; weights
  included; ``peak_prefill_gib`` / ``peak_decode_gib`` per phase; ``weights_gib``);
* ``cache_bytes`` after the run (P + new_tokens - 1 tokens cached per sequence): the hybrid's
  ``HybridCache.memory_bytes()`` split into ``cache_bytes_kv`` (MLA latents + RoPE keys, growing with the
  length) and ``cache_bytes_recurrent`` (constant states); the teacher's sum of the DynamicCache key / value
  tensors' bytes (all of it ``cache_bytes_kv``); ``cache_bytes_per_token_per_seq`` and
  ``cache_bytes_kv_per_token_per_seq`` divide by ``B * cached_tokens``; ``predicted_cache_bytes_kv`` from
  :func:`hybridlm.kv_report.kv_report` of the hybrid's MLA layers.

An out-of-memory error (``torch.cuda.OutOfMemoryError``, or a RuntimeError saying so) makes the entry
``status: "oom"`` (with the phase) and stops the larger batches of that model and prompt length.
``comparisons`` pair the two models at each (P, B): decode and end-to-end speedups (hybrid / teacher), the
measured KV ratio ``teacher cache_bytes_kv / hybrid cache_bytes_kv`` next to the one kv_report predicts, the
ratio of whole caches (recurrent states included) and of peak memory; ``target`` is the project's
(>= 1.5x the teacher at P 8192, B 48). ``DIR/generation.json`` and ``DIR/generation.png`` (decode tokens/s
and peak memory against the batch, one line per model per prompt length, OOM marked) are rewritten after
every entry, so a run cut off by a time limit still leaves what it measured.

**--cuda-graph** (hybrid only; the teacher keeps its DynamicCache and eager steps): prefill eagerly into a
static :class:`~hybridlm.model.cache.HybridCache` of ``P + new_tokens - 1`` positions, then decode by
replaying one CUDA graph of the single-token step (:class:`~hybridlm.model.graphs.GraphedDecoder`). Entries
record ``cuda_graph``, ``decode_path`` and ``graph_capture_s`` (warm-up + capture, timed between prefill and
decode and counted in neither).

**--via generate**: each model through its own ``model.generate()`` (greedy, EOS off, full rows) instead of the
loop: the hybrid's takes the static-cache + CUDA-graph fast path on CUDA by itself
(:mod:`hybridlm.model.fast_generate`; ``decode_path`` says which path it took), the teacher's is transformers'
(``--teacher-cache static`` for its StaticCache). ``prefill_s`` is a 1-token call, ``decode_s`` an N-token call
minus it, both after a warm-up call of the same shape (``first_call_s``: that first N-token call, compiles and the
hybrid's graph capture included); cache sizes are not recorded (generate keeps its cache).
"""
from __future__ import annotations

import argparse
import inspect
from contextlib import contextmanager
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.harness.common import free_memory, is_oom, merge_reports, versions, write_report
from benchmarks.harness.profile_step import StepProfiler, format_profile
from hybridlm.kv_report import kv_report, load_teacher_config
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.cache import HybridCache
from hybridlm.model.fast_generate import fast_path_plan
from hybridlm.model.generate import greedy_generate
from hybridlm.model.graphs import GraphedDecoder
from hybridlm.model.pattern import student_kinds
from hybridlm.ops.backend import use_triton
from hybridlm.teacher import load_teacher, resolve_teacher
from hybridlm.utils.atomic import save_figure

MODELS = ("hybrid", "teacher")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OOM = "oom"
TARGET = {"prompt_len": 8192, "batch": 48, "min_speedup": 1.5}
GIB = 2 ** 30


# ---------------------------------------------------------------------------------------- utilities


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: torch.nn.Module) -> int:
    seen = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:  # tied embeddings count once
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# ------------------------------------------------------------------------------------------ models

def load_hybrid(path: str, dtype: torch.dtype, device: torch.device):
    model = HybridForCausalLM.from_pretrained(str(Path(path).expanduser()), dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def decode_runtime(args) -> Dict[str, bool]:
    """The hybrid's decode-kernel runtime settings from the --mamba2-fused-step, --mla-split-k, --graph-small-kernels
    and --graph-fuse-residual flags, for ``model.set_runtime``."""
    return {"mamba2_fused_step": args.mamba2_fused_step == "on", "mla_split_k_decode": args.mla_split_k == "on",
            "graph_small_kernels": args.graph_small_kernels == "on",
            "graph_fuse_residual": args.graph_fuse_residual == "on"}


def load_teacher_model(spec: str, dtype: torch.dtype, device: torch.device):
    """The Llama teacher through the project's strict loader, with transformers' sdpa attention."""
    model = load_teacher(spec, dtype=dtype)
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        model.set_attn_implementation("sdpa")
    return model.to(device=device, dtype=dtype).eval()


def _cache_kwarg(model) -> str:
    """The forward's name for the cache: ``cache`` (transformers >= 5.2x, and the hybrid) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _output_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def cache_stats(cache) -> Dict[str, int]:
    """Bytes held by a HybridCache (split into KV latents and recurrent states) or a transformers KV cache."""
    if isinstance(cache, HybridCache):
        kv, rec = cache.memory_bytes("mla"), cache.memory_bytes("recurrent")
        return {"cache_bytes": cache.memory_bytes(), "cache_bytes_kv": kv, "cache_bytes_recurrent": rec}
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        tensors = [getattr(layer, name, None) for layer in layers for name in ("keys", "values")]
    else:  # older transformers: key_cache / value_cache lists
        tensors = list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", []))
    for t in tensors:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return {"cache_bytes": total, "cache_bytes_kv": total, "cache_bytes_recurrent": 0}


# ------------------------------------------------------------------------------------- decode loop

class DecodeRun:
    """One greedy run: generated ``tokens [B, new_tokens]``, the final cache, phase times and peaks."""

    def __init__(self):
        self.tokens: Optional[torch.Tensor] = None
        self.cache = None
        self.prefill_s = self.decode_s = 0.0
        self.peak_prefill: Optional[int] = None
        self.peak_decode: Optional[int] = None
        self.phase = "prefill"
        self.capture_s: Optional[float] = None  # --cuda-graph: the one-time warm-up + capture of the step
        self.graph_replayed = False


def _is_hybrid(model) -> bool:
    return isinstance(model, HybridForCausalLM)


@torch.inference_mode()
def greedy_decode(model, input_ids: torch.LongTensor, new_tokens: int, run: Optional[DecodeRun] = None,
                  cuda_graph: bool = False) -> DecodeRun:
    """Prefill over ``input_ids`` then ``new_tokens - 1`` cached single-token steps, argmax each time.

    The same loop serves the hybrid and the Llama teacher. Times are taken around device synchronisations;
    the generated ids stay on the device (no host sync inside the loop). ``run.phase`` tells where an
    out-of-memory error happened.

    ``cuda_graph`` (the hybrid only): the prompt is prefilled eagerly into a static
    :class:`~hybridlm.model.cache.HybridCache` of exactly ``P + new_tokens - 1`` positions, and the decode
    steps are replays of one CUDA graph of the step (:class:`~hybridlm.model.graphs.GraphedDecoder`; eager
    steps on the static cache where there is no CUDA). The graph's warm-up and capture happen between the
    two timed phases and are timed apart (``run.capture_s``)."""
    if new_tokens < 1:
        raise ValueError("new_tokens must be >= 1")
    if cuda_graph and not _is_hybrid(model):
        raise ValueError("cuda_graph: only the hybrid's static HybridCache path is graph-captured")
    run = run or DecodeRun()
    device = input_ids.device
    cuda = device.type == "cuda"
    key = _cache_kwarg(model)
    B = input_ids.shape[0]
    tokens = torch.empty(B, new_tokens, dtype=torch.long, device=device)

    run.phase = "prefill"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    if cuda_graph:
        cache = HybridCache(model.config, max_length=input_ids.shape[1] + new_tokens - 1, batch_size=B,
                            dtype=model.dtype, device=device)
        out = model(input_ids=input_ids, cache=cache, logits_to_keep=1)
    else:
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        cache = _output_cache(out)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens[:, :1] = nxt
    del out
    sync(device)
    t1 = time.perf_counter()
    if cuda:
        run.peak_prefill = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    run.phase = "decode"
    if cuda_graph:
        run.phase = "graph capture"
        decoder = GraphedDecoder(model, cache)
        if new_tokens > 1:
            decoder.capture()
        sync(device)
        run.capture_s, run.graph_replayed = time.perf_counter() - t1, decoder.enabled
        run.phase = "decode"
        t1 = time.perf_counter()
        for i in range(1, new_tokens):
            nxt = decoder.step(nxt)[:, -1].argmax(-1, keepdim=True)
            tokens[:, i:i + 1] = nxt
        del decoder
    else:
        for i in range(1, new_tokens):
            out = model(input_ids=nxt, use_cache=True, **{key: cache})
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens[:, i:i + 1] = nxt
            del out
    sync(device)
    t2 = time.perf_counter()
    if cuda:
        run.peak_decode = torch.cuda.max_memory_allocated(device)
    run.tokens, run.cache = tokens, cache
    run.prefill_s, run.decode_s = t1 - t0, t2 - t1
    run.phase = "done"
    return run


@contextmanager
def eos_disabled(model):
    """The model's generation config without an EOS id (a passed ``eos_token_id=None`` would fall back to the
    model's default), so that ``generate`` produces exactly ``max_new_tokens`` tokens."""
    gen_cfg = getattr(model, "generation_config", None)
    saved = None if gen_cfg is None else gen_cfg.eos_token_id
    if gen_cfg is not None:
        gen_cfg.eos_token_id = None
    try:
        yield
    finally:
        if gen_cfg is not None:
            gen_cfg.eos_token_id = saved


@torch.inference_mode()
def generate_reference(model, input_ids: torch.LongTensor, new_tokens: int) -> torch.LongTensor:
    """``model.generate`` greedy, exactly ``new_tokens`` tokens (EOS disabled, ``min_new_tokens`` =
    ``max_new_tokens``: transformers' own loop for the hybrid too); returns the new tokens ``[B, new_tokens]``."""
    with eos_disabled(model):
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, input_ids.shape[1]:]


@torch.inference_mode()
def generate_decode(model, input_ids: torch.LongTensor, new_tokens: int, run: Optional[DecodeRun] = None,
                    **generate_kwargs) -> DecodeRun:
    """``model.generate()`` as a user calls it (greedy, full rows, EOS off so exactly ``new_tokens`` tokens):
    the hybrid's own ``generate`` (on CUDA its static-cache + CUDA-graph fast path) or transformers' for the
    teacher (``generate_kwargs``, e.g. ``cache_implementation="static"``). ``generate`` has no phase boundary to
    time, so ``prefill_s`` is a call for one token (prompt forward, first token, generate's set-up: a static
    cache's allocation and a graph's capture included) and ``decode_s`` what an ``new_tokens`` call takes beyond
    it: the per-step cost through ``generate``, its per-step overhead included."""
    run = run or DecodeRun()
    device = input_ids.device
    cuda = device.type == "cuda"

    def timed(n: int):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        with eos_disabled(model):
            out = model.generate(input_ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **generate_kwargs)
        sync(device)
        return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated(device) if cuda else None

    run.phase = "prefill"
    _, first_s, run.peak_prefill = timed(1)
    run.phase = "decode"
    out, all_s, run.peak_decode = timed(new_tokens)
    run.tokens, run.cache = out[:, input_ids.shape[1]:], None
    run.prefill_s, run.decode_s = first_s, max(all_s - first_s, 0.0)
    run.phase = "done"
    return run


@torch.inference_mode()
def profile_decode(model, input_ids: torch.LongTensor, steps: int) -> Dict[str, Any]:
    """Where a decode step's time goes: ``steps`` single-token steps on a static cache, launched one by one (the
    kernels a CUDA-graph replay runs), under torch.profiler: device time per category, the top kernels and the
    kernel launches per step. Their total against the replayed step's ms per step separates the kernels' own
    time from the time between them."""
    B, P = input_ids.shape
    cache = HybridCache(model.config, max_length=P + steps + 2, batch_size=B, dtype=model.dtype,
                        device=input_ids.device)
    nxt = model(input_ids=input_ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    decoder = GraphedDecoder(model, cache, enabled=False)
    # the kernels of the captured step (the model's runtime.graph_small_kernels and runtime.graph_fuse_residual:
    # fla's small kernels, residual adds in the norms)
    with decoder.kernel_choices():
        for _ in range(2):  # compiles and autotuning stay out of the profile
            nxt = decoder.step(nxt)[:, -1].argmax(-1, keepdim=True)
        profiler = StepProfiler(skip=0, active=steps, device=input_ids.device)
        for _ in range(steps):
            nxt = decoder.step(nxt)[:, -1].argmax(-1, keepdim=True)
            profiler()
    return profiler.summary()


def generate_kwargs(name: str, args) -> Dict[str, Any]:
    """What ``--via generate`` passes to the model's ``generate`` besides the prompt and length."""
    if name == "teacher" and getattr(args, "teacher_cache", "dynamic") == "static":
        return {"cache_implementation": "static"}
    return {}


def leading_agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading positions of two ``[B, N]`` token tensors agree in every row."""
    same = (a.cpu() == b.cpu()).all(0).tolist()
    return next((i for i, ok in enumerate(same) if not ok), len(same))


def check_tokens(model, input_ids: torch.LongTensor, tokens: torch.LongTensor) -> Dict[str, Any]:
    """The loop's ``tokens [B, N]`` against ``model.generate`` (greedy, same cache path) and against N full
    forwards without any cache (:func:`hybridlm.model.generate.greedy_generate`). In bf16 the uncached path
    may drift from the cached one after some tokens (different kernels), hence counts, not only a flag."""
    n = tokens.shape[1]
    gen = leading_agreement(generate_reference(model, input_ids, n), tokens)
    full = leading_agreement(greedy_generate(model, input_ids, n)[:, input_ids.shape[1]:], tokens)
    return {"check_tokens": n, "matches_generate": gen == n, "generate_agree_tokens": gen,
            "full_forward_agree_tokens": full}


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int, device: torch.device) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).to(device)


# --------------------------------------------------------------------------------------- predictions

def mla_teacher_layers(hybrid_cfg) -> List[int]:
    """Teacher-layer indices whose mixer is MLA in an upcycled hybrid (mixer 2i + MLP 2i+1 per teacher layer)."""
    return [i for i, k in enumerate(student_kinds(hybrid_cfg, "hybrid")) if k == "mla"]


def predict_kv(hybrid_cfg, teacher_cfg, bytes_per_value: int) -> Dict[str, Any]:
    """``hybridlm.kv_report`` of the hybrid's MLA layers against the teacher (bytes per token per sequence)."""
    try:
        a = hybrid_cfg.mixer_args("mla")
        rep = kv_report(teacher_cfg, mla_teacher_layers(hybrid_cfg), a.kv_lora_rank, a.qk_rope_head_dim,
                        bytes_per_value=bytes_per_value)
    except Exception as e:  # noqa: BLE001 - a prediction that cannot be made is reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}
    rep.pop("per_layer", None)
    return rep


def _teacher_config(spec: str):
    """The teacher's LlamaConfig without loading its weights (None where only loading would tell)."""
    try:
        return load_teacher_config(resolve_teacher(spec))
    except Exception:  # noqa: BLE001 - e.g. a .gguf file: the config comes with the loaded model
        return None


# ------------------------------------------------------------------------------------------ entries

def measure_entry(model, name: str, prompt_len: int, batch: int, args, device: torch.device,
                  vocab: int, check_generate: int = 0) -> Dict[str, Any]:
    """One (model, prompt length, batch) entry: warm-up, ``args.repeats`` timed runs, cache accounting."""
    entry: Dict[str, Any] = {"model": name, "prompt_len": prompt_len, "batch": batch, "new_tokens": args.new_tokens}
    via = getattr(args, "via", "loop")
    graph = bool(getattr(args, "cuda_graph", False)) and name == "hybrid" and via == "loop"
    entry["cuda_graph"] = graph
    entry["decode_via"] = via
    decode_kw = {"cuda_graph": True} if graph else {}
    decode = greedy_decode
    if via == "generate":
        decode = generate_decode
        decode_kw = generate_kwargs(name, args)
        entry["generate_kwargs"] = decode_kw
    run = DecodeRun()
    runs: List[Tuple[float, float, Optional[int], Optional[int]]] = []
    captures: List[float] = []
    failed = None
    stats: Dict[str, int] = {}
    checks: Optional[Dict[str, Any]] = None
    where = "warm-up "
    try:
        ids = make_prompts(batch, prompt_len, vocab, args.seed, device)
        if via == "generate" and name == "hybrid":
            plan, why = fast_path_plan(model, ids, None, dict(max_new_tokens=args.new_tokens, do_sample=False))
            entry["decode_path"] = ("generate(): static HybridCache + CUDA graph (graphed_generate)" if plan
                                    else f"generate(): transformers' eager loop ({why or 'not on CUDA'})")
        if args.warmup_steps > 0:
            # through generate() the warm-up is a call of the timed shape: the timed calls then cost what a repeated
            # call costs (the hybrid's fast path keeps its cache and captured step), the first call's compiles and
            # capture are recorded apart (first_call_s)
            warm_tokens = args.new_tokens if via == "generate" else min(args.new_tokens, args.warmup_steps + 1)
            warm = decode(model, ids, warm_tokens, run, **decode_kw)
            if via == "generate":
                entry["first_call_s"] = warm.prefill_s + warm.decode_s
        where = ""
        for r in range(args.repeats):
            run = DecodeRun()
            decode(model, ids, args.new_tokens, run, **decode_kw)
            runs.append((run.prefill_s, run.decode_s, run.peak_prefill, run.peak_decode))
            if graph:
                captures.append(run.capture_s)
                entry["graph_replayed"] = run.graph_replayed
            if r == 0:
                stats = cache_stats(run.cache) if run.cache is not None else {}
                if getattr(args, "profile_decode", 0) and name == "hybrid" and via == "loop":
                    run.phase = "decode profile"
                    entry["decode_profile"] = profile_decode(model, ids, args.profile_decode)
                if check_generate:
                    run.phase = "generate check"
                    checks = check_tokens(model, ids, run.tokens[:, :min(check_generate, args.new_tokens)])
            run.cache = run.tokens = None
    except Exception as e:  # noqa: BLE001 - only OOM is caught, anything else re-raised
        if not is_oom(e):
            raise
        failed = where + run.phase
    run = None
    free_memory()
    if failed:
        entry.update(status=OOM, oom_phase=failed)
        return entry

    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    steps = args.new_tokens - 1
    cached = prompt_len + args.new_tokens - 1  # the last generated token is never fed back
    entry.update(
        status="ok", repeats=len(runs), decode_steps=steps, cached_tokens=cached,
        prefill_s=prefill, decode_s=decode, e2e_s=prefill + decode,
        prefill_tokens_per_s=batch * prompt_len / prefill,
        decode_tokens_per_s=batch * steps / decode if steps else None,
        decode_ms_per_step=1e3 * decode / steps if steps else None,
        e2e_tokens_per_s=batch * args.new_tokens / (prefill + decode),
        prefill_s_all=[round(r[0], 6) for r in runs], decode_s_all=[round(r[1], 6) for r in runs],
    )
    if graph:  # one-time setup, not in decode_s / e2e (a server captures once per batch shape)
        entry.update(decode_path="static HybridCache + CUDA graph" if entry.get("graph_replayed")
                     else "static HybridCache, eager steps (no CUDA)",
                     graph_capture_s=statistics.median(captures))
    if device.type == "cuda":
        pp = max(r[2] for r in runs)
        pd = max(r[3] for r in runs)
        entry.update(peak_gib=max(pp, pd) / GIB, peak_prefill_gib=pp / GIB, peak_decode_gib=pd / GIB)
    else:
        entry.update(peak_gib=None, peak_prefill_gib=None, peak_decode_gib=None)
    per_seq_tokens = batch * cached
    entry.update(stats or {"cache_bytes": None, "cache_bytes_kv": None, "cache_bytes_recurrent": None})
    if stats:  # generate() keeps its cache to itself
        entry["cache_bytes_per_token_per_seq"] = stats["cache_bytes"] / per_seq_tokens
        entry["cache_bytes_kv_per_token_per_seq"] = stats["cache_bytes_kv"] / per_seq_tokens
    if checks is not None:
        entry.update(checks)
    return entry


def compare(entries: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Hybrid against teacher at every (prompt length, batch) both measured."""
    ok = {(e["model"], e["prompt_len"], e["batch"]): e for e in entries if e.get("status") == "ok"}
    rows = []
    for (model, P, B), h in sorted(ok.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        t = ok.get(("teacher", P, B))
        if model != "hybrid" or t is None:
            continue
        row: Dict[str, Any] = {"prompt_len": P, "batch": B}
        if h.get("decode_tokens_per_s") and t.get("decode_tokens_per_s"):
            row["decode_speedup"] = h["decode_tokens_per_s"] / t["decode_tokens_per_s"]
        row["e2e_speedup"] = h["e2e_tokens_per_s"] / t["e2e_tokens_per_s"]
        row["prefill_speedup"] = t["prefill_s"] / h["prefill_s"]
        row["kv_ratio_measured"] = t["cache_bytes_kv"] / h["cache_bytes_kv"] \
            if h.get("cache_bytes_kv") and t.get("cache_bytes_kv") else None
        row["kv_ratio_predicted"] = h.get("kv_ratio_predicted")
        row["cache_ratio_total"] = t["cache_bytes"] / h["cache_bytes"] \
            if h.get("cache_bytes") and t.get("cache_bytes") else None
        if h.get("peak_gib") and t.get("peak_gib"):
            row["peak_memory_ratio"] = t["peak_gib"] / h["peak_gib"]
        rows.append(row)
    return rows


def target_result(report: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(TARGET)
    row = next((r for r in report["comparisons"]
                if r["prompt_len"] == TARGET["prompt_len"] and r["batch"] == TARGET["batch"]), None)
    if row is None:
        status = {(e["model"], e["prompt_len"], e["batch"]): e["status"] for e in report["entries"]}
        out["status"] = ("not measured: " + ", ".join(
            f"{m} {status.get((m, TARGET['prompt_len'], TARGET['batch']), 'missing')}" for m in MODELS))
        return out
    out.update(decode_speedup=row.get("decode_speedup"), e2e_speedup=row["e2e_speedup"])
    out["met_decode"] = row.get("decode_speedup") is not None and row["decode_speedup"] >= TARGET["min_speedup"]
    out["met_e2e"] = row["e2e_speedup"] >= TARGET["min_speedup"]
    out["status"] = "measured"
    return out


# ------------------------------------------------------------------------------------------- output

def progress_line(e: Dict[str, Any], t0: float) -> str:
    head = f"[{time.perf_counter() - t0:6.0f}s] {e['model']:<7} P={e['prompt_len']:<5} B={e['batch']:<3}"
    if e["status"] != "ok":
        return f"{head} {e['status']} (in {e.get('oom_phase')}); larger batches skipped"
    peak = f"{e['peak_gib']:6.2f} GiB" if e.get("peak_gib") is not None else "(cpu)"
    dec = (f"decode {e['decode_tokens_per_s']:>10,.0f} tok/s ({e['decode_ms_per_step']:7.2f} ms/step)"
           if e.get("decode_tokens_per_s") else "decode -")
    line = f"{head} prefill {e['prefill_s']:7.3f} s  {dec}  e2e {e['e2e_tokens_per_s']:>10,.0f} tok/s  peak {peak}"
    if e.get("cache_bytes") is not None:
        line += (f"  cache {e['cache_bytes'] / 2**20:9.2f} MiB ({e['cache_bytes_kv_per_token_per_seq']:,.0f} "
                 f"B/token/seq KV)")
    if e.get("decode_via") == "generate":
        line += f"  via generate({', '.join(f'{k}={v!r}' for k, v in e.get('generate_kwargs', {}).items())})"
    if "check_tokens" in e:
        line += (f"  agree with generate {e['generate_agree_tokens']}/{e['check_tokens']}, "
                 f"full forwards {e['full_forward_agree_tokens']}/{e['check_tokens']}")
    return line


def plot(report: Dict[str, Any], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["entries"]
    colors = {"hybrid": "#2a6f97", "teacher": "#c9a227"}
    prompt_lens = sorted({e["prompt_len"] for e in entries})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, ylabel in ((axes[0], "decode_tokens_per_s", "decode tokens/s"),
                            (axes[1], "peak_gib", "peak memory allocated (GiB)")):
        drawn = False
        for model in MODELS:
            for j, P in enumerate(prompt_lens):
                rows = sorted((e for e in entries if e["model"] == model and e["prompt_len"] == P),
                              key=lambda e: e["batch"])
                pts = [(e["batch"], e[key]) for e in rows if e["status"] == "ok" and e.get(key)]
                style = dict(color=colors.get(model, "gray"), linestyle=styles[j % len(styles)])
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{model} P={P}", **style)
                    drawn = True
                for e in rows:
                    if e["status"] == OOM:
                        y = pts[-1][1] if pts else None
                        if y is None:
                            ax.annotate("OOM", (e["batch"], 0.02), xycoords=("data", "axes fraction"),
                                        color=style["color"], ha="center", fontsize=8)
                        else:
                            ax.plot([e["batch"]], [y], marker="x", markersize=10, markeredgewidth=2,
                                    color=style["color"], linestyle="none")
                            ax.annotate("OOM", (e["batch"], y), textcoords="offset points", xytext=(4, 4),
                                        color=style["color"], fontsize=8)
        ax.set_xscale("log", base=2)
        ticks = sorted({e["batch"] for e in entries})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(b) for b in ticks])
        ax.minorticks_off()
        ax.set_xlabel("batch")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured (no CUDA)" if key == "peak_gib" else "no data", ha="center",
                    va="center", transform=ax.transAxes)
    fig.suptitle(f"Greedy generation, {report.get('new_tokens')} new tokens, {report.get('dtype')}, "
                 f"{report.get('gpu') or 'cpu'} (x: OOM)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, png, dpi=120)


def finalize(report: Dict[str, Any]) -> Dict[str, Any]:
    report["comparisons"] = compare(report["entries"])
    report["target"] = target_result(report)
    return report


def write(report: Dict[str, Any], out: Path) -> None:
    finalize(report)
    write_report(report, out / "generation.json")
    plot(report, out / "generation.png")


def merge(paths: Sequence[str], out: Path) -> Dict[str, Any]:
    """Entries of several reports (a later one replaces an entry of the same model, prompt length and batch)."""
    derived = ("comparisons", "target")
    reports, merged = merge_reports(paths, lambda e: (e["model"], e["prompt_len"], e["batch"]), derived)
    for r in reports:  # a report's model facts (kv prediction, config) fill in what the first lacked
        for k, v in r.items():
            if k not in ("entries", *derived) and merged.get(k) in (None, {}):
                merged[k] = v
    merged["entries"].sort(key=lambda e: (MODELS.index(e["model"]), e["prompt_len"], e["batch"]))
    write(merged, out)
    return merged


# --------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.generation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for generation.json and generation.png")
    p.add_argument("--hybrid", help="hybrid model directory (e.g. an `upcycle run`'s final hybrid)")
    p.add_argument("--teacher", help="the Llama teacher: a transformers directory, a .gguf file or asset:smollm2")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="which models to measure")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--new-tokens", type=int, default=1024, help="tokens generated per sequence (exactly)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64, 96, 128],
                   help="measured in increasing order until one runs out of memory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per entry (medians reported)")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="untimed warm-up per entry: a prefill of the same shape + this many decode steps (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--check-generate", type=int, default=0, metavar="N",
                   help="compare the loop's first N tokens with model.generate (smallest batch of each model "
                        "and prompt length; recorded as matches_generate)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="decode the hybrid through a static HybridCache and one CUDA graph of the decode step "
                        "replayed per token (prefill eager; the teacher is unchanged)")
    p.add_argument("--via", choices=("loop", "generate"), default="loop",
                   help="loop: the explicit greedy loop (default); generate: model.generate() as a user calls it "
                        "(the hybrid's fast path on CUDA; ms per step = an N-token call minus a 1-token call)")
    p.add_argument("--teacher-cache", choices=("dynamic", "static"), default="dynamic",
                   help="--via generate: the teacher's cache_implementation (transformers' DynamicCache or "
                        "StaticCache)")
    p.add_argument("--mamba2-fused-step", choices=("on", "off"), default="on",
                   help="the hybrid's Mamba2 layers decode a cached token in one fused Triton kernel (on, the "
                        "default) or through the unfused ops (off: the before of a before / after)")
    p.add_argument("--mla-split-k", choices=("on", "off"), default="on",
                   help="the hybrid's MLA layers attend to the cache through the split-K Triton kernel "
                        "(hybridlm/ops/latent_decode.py; on, the default) or SDPA (off: the before of a before / after)")
    p.add_argument("--graph-small-kernels", choices=("on", "off"), default="on",
                   help="the hybrid's captured decode step runs its norms and SwiGLU through fla's fused Triton "
                        "kernels (on, the default: fewer graph nodes) or the torch ops of an eager decode "
                        "step (off: the before of a before / after)")
    p.add_argument("--graph-fuse-residual", choices=("on", "off"), default="on",
                   help="the hybrid's captured decode step leaves each block's residual add to the next norm's "
                        "fused kernel (on, the default: one kernel where there were two) or adds apart (off: the "
                        "before of a before / after)")
    p.add_argument("--sdpa-cudnn", action="store_true",
                   help="leave cuDNN in SDPA's backend choice (default: off for both models; it builds a new "
                        "execution plan for every key length, i.e. at every eager decoding step)")
    p.add_argument("--profile-decode", type=int, default=0, metavar="N",
                   help="the hybrid (explicit loop): N more decode steps on a static cache under torch.profiler, "
                        "launched one by one; device time per kernel category, top kernels and launches per step "
                        "recorded as decode_profile")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="only merge these reports into --out (JSON + PNG), run nothing")
    args = p.parse_args(argv)
    if not args.merge:
        if "hybrid" in args.models and not args.hybrid:
            p.error("--hybrid is required to measure the hybrid")
        if ("teacher" in args.models or "hybrid" in args.models) and not args.teacher:
            p.error("--teacher is required (the teacher is measured, and its config predicts the KV ratio)")
        if args.new_tokens < 1 or args.repeats < 1 or args.warmup_steps < 0 or args.profile_decode < 0:
            p.error("--new-tokens and --repeats must be >= 1, --warmup-steps and --profile-decode >= 0")
        if min(args.prompt_lens) < 1 or min(args.batches) < 1:
            p.error("--prompt-lens and --batches must be >= 1")
    return args


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    if args.merge:
        return merge(args.merge, out)
    t0 = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    dtype = DTYPES[args.dtype]
    nbytes = torch.empty((), dtype=dtype).element_size()
    if cuda:  # one SDPA backend policy for both models (the hybrid's cached MLA leaves cuDNN out itself)
        torch.backends.cuda.enable_cudnn_sdp(args.sdpa_cudnn)

    report: Dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "gpu_memory_gib": torch.cuda.get_device_properties(device).total_memory / GIB if cuda else None,
        **versions(), "device": str(device), "dtype": args.dtype, "hybrid": args.hybrid, "teacher": args.teacher,
        "prompt_lens": args.prompt_lens, "new_tokens": args.new_tokens, "batches": sorted(set(args.batches)),
        "repeats": args.repeats, "warmup_steps": args.warmup_steps, "seed": args.seed,
        "cuda_graph": args.cuda_graph, "via": args.via, "mamba2_fused_step": args.mamba2_fused_step,
        "mla_split_k": args.mla_split_k, "teacher_cache": args.teacher_cache, "profile_decode": args.profile_decode,
        "graph_small_kernels": args.graph_small_kernels,
        "graph_fuse_residual": args.graph_fuse_residual,
        "sdpa_cudnn": args.sdpa_cudnn if cuda else None,
        "method": "explicit greedy loop shared by both models: prefill forward (use_cache, logits_to_keep=1) + "
                  "new_tokens-1 cached single-token forwards, argmax, no mask, no stopping; cuda-synchronised "
                  "timing of prefill and decode" if args.via == "loop" else
                  "model.generate() greedy, EOS off, full rows; prefill_s = a 1-token call, decode_s = an "
                  "N-token call minus it, after a warm-up N-token call (first_call_s); cuda-synchronised",
        "command": " ".join(sys.argv), "started": datetime.now(timezone.utc).isoformat(),
        "kv_prediction": None, "models": {}, "entries": [],
    }
    teacher_cfg = _teacher_config(args.teacher) if args.teacher else None
    hybrid_cfg = None
    if args.hybrid:
        hybrid_cfg = HybridConfig.from_pretrained(str(Path(args.hybrid).expanduser()))

    def predict(tcfg) -> None:
        if hybrid_cfg is not None and tcfg is not None and report["kv_prediction"] is None:
            report["kv_prediction"] = predict_kv(hybrid_cfg, tcfg, nbytes)

    predict(teacher_cfg)

    def add(entry: Dict[str, Any]) -> None:
        pred = report["kv_prediction"] or {}
        if entry["status"] == "ok" and "hybrid_bytes_per_token" in pred:
            key = "hybrid_bytes_per_token" if entry["model"] == "hybrid" else "teacher_bytes_per_token"
            entry["predicted_cache_bytes_kv"] = pred[key] * entry["batch"] * entry["cached_tokens"]
            if entry["model"] == "hybrid":
                entry["kv_ratio_predicted"] = pred.get("compression")
        report["entries"].append(entry)
        print(progress_line(entry, t0), flush=True)
        if entry.get("decode_profile"):
            print(format_profile(entry["decode_profile"]), flush=True)
        write(report, out)

    for name in MODELS:
        if name not in args.models:
            continue
        print(f"[{time.perf_counter() - t0:6.0f}s] loading {name}", flush=True)
        if name == "hybrid":
            model = load_hybrid(args.hybrid, dtype, device)
            model.set_runtime(**decode_runtime(args))  # this model's decode kernels: nothing process-wide
            probe = torch.empty(1, device=device)
            info = {"path": args.hybrid, "pattern": model.config.hybrid_override_pattern,
                    "backend": model.runtime.backend,
                    "kernels": "triton (fla)" if use_triton(model.runtime.backend, probe) else "torch",
                    "cache": "HybridCache (static) + CUDA graph decode" if args.cuda_graph else "HybridCache"}
        else:
            model = load_teacher_model(args.teacher, dtype, device)
            predict(model.config)
            info = {"path": args.teacher, "attn_implementation": model.config._attn_implementation,
                    "cache": "DynamicCache (transformers default)", "num_hidden_layers": model.config.num_hidden_layers}
        info.update(params=sum(p.numel() for p in model.parameters()), weights_gib=weight_bytes(model) / GIB,
                    vocab_size=model.config.vocab_size)
        report["models"][name] = info
        vocab = model.config.vocab_size
        try:
            for P in args.prompt_lens:
                checked = False
                for B in sorted(set(args.batches)):
                    entry = measure_entry(model, name, P, B, args, device, vocab,
                                          check_generate=0 if checked else args.check_generate)
                    checked = checked or entry["status"] == "ok"
                    entry["weights_gib"] = info["weights_gib"]
                    add(entry)
                    if entry["status"] != "ok":
                        break
        finally:
            del model
            free_memory()
    write(report, out)
    print(f"wrote {out / 'generation.json'} and {out / 'generation.png'}", flush=True)
    return report


if __name__ == "__main__":
    main()
