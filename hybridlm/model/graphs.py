"""A decode step of a :class:`~hybridlm.model.HybridForCausalLM` captured once in a CUDA graph and replayed.

A small model's single-token step is hundreds of small kernels; launched from Python one by one they, not
the GPU, set the decode speed. :class:`GraphedDecoder` records the whole step
``model(input_ids=static_ids [B, 1], cache=static_cache)`` once and then replays it per token, which needs
every tensor it touches at a fixed address with a fixed shape: hence a *static*
:class:`~hybridlm.model.cache.HybridCache` (preallocated, updated in place, the position kept in a device
counter that the step itself advances). Per step only the new token ids are copied into the graph's input
buffer; nothing syncs with the host.

    cache = HybridCache(model.config, max_length=P + new_tokens - 1, batch_size=B, dtype=model.dtype, device="cuda")
    logits = model(input_ids=prompt, cache=cache, logits_to_keep=1).logits   # prefill: eager
    decoder = GraphedDecoder(model, cache)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new_tokens - 1):
        nxt = decoder.step(nxt)[:, -1].argmax(-1, keepdim=True)

The graph is captured at the first :meth:`GraphedDecoder.step` (or :meth:`GraphedDecoder.capture`), after
warm-up runs on a side stream (Triton autotuning, cuBLAS workspaces), as ``torch.cuda.graphs`` requires. The
warm-up and the capture leave the cache exactly as they found it (its buffers are snapshotted and restored),
so capturing can happen at any point of a generation. The graph stays bound to that cache: ``cache.reset()``
(in place) and a new prefill reuse it; a new cache needs a new decoder. The returned logits live in the
graph's output buffer and are overwritten by the next step (clone them to keep them).

On CPU (or ``enabled=False``) :meth:`step` simply calls the model on the static cache: the same API and the
same results, so the logic is testable without a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from hybridlm.model.cache import FIXED_SHAPES, HybridCache
from hybridlm.model.runtime import DECODE_RUNTIME_KEYS
from hybridlm.ops.backend import residual_adds_in_norms, small_calls_through_kernels


class GraphedDecoder:
    """Single-token decode steps of ``model`` on the static ``cache``, replayed from one CUDA graph."""

    def kernel_choices(self) -> contextlib.ExitStack:
        """The context a captured step is warmed up and recorded in: fixed shapes (:data:`cache.FIXED_SHAPES`), the
        model's ``runtime.graph_small_kernels`` and ``runtime.graph_fuse_residual``, as they are at the capture (a
        captured graph keeps what it recorded)."""
        runtime = self.model.config.runtime
        stack = contextlib.ExitStack()
        stack.enter_context(FIXED_SHAPES.on())  # attention over the whole static buffer: one shape every step
        if runtime.graph_small_kernels:
            stack.enter_context(small_calls_through_kernels())
        if runtime.graph_fuse_residual:
            stack.enter_context(residual_adds_in_norms())
        return stack

    def __init__(self, model, cache: HybridCache, enabled: Optional[bool] = None, warmup_steps: int = 3):
        if not isinstance(cache, HybridCache) or not cache.is_static:
            raise ValueError("GraphedDecoder needs a static HybridCache (HybridCache(config, max_length=..., "
                             "batch_size=..., dtype=..., device=...))")
        self.model, self.cache = model, cache
        self.device = cache.length.device
        cuda = self.device.type == "cuda"
        if enabled and not cuda:
            raise ValueError(f"CUDA graphs need a CUDA cache, this one is on {self.device}")
        self.enabled = cuda if enabled is None else bool(enabled)
        self.warmup_steps = warmup_steps
        self.batch_size = cache.static_batch_size
        with self._grad_mode():  # an inference tensor when the cache's are
            self.static_ids = torch.zeros(self.batch_size, 1, dtype=torch.long, device=self.device)
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.static_logits: Optional[torch.Tensor] = None

    # -----------------------------------------------------------------------------------------
    def _grad_mode(self):
        """Inference mode when the cache was made under it (its buffers are then inference tensors)."""
        return torch.inference_mode() if self.cache.length.is_inference() else torch.no_grad()

    def _forward(self) -> torch.Tensor:
        return self.model(input_ids=self.static_ids, cache=self.cache).logits

    def _check_room(self) -> None:
        if self.cache.get_seq_length() + 1 > self.cache.max_length:
            raise ValueError(f"static HybridCache full: {self.cache.get_seq_length()} tokens cached, max_length "
                             f"{self.cache.max_length}")

    def capture(self) -> None:
        """Warm up on a side stream, then record one step; the cache is restored after each (nothing advances)."""
        if not self.enabled or self.graph is not None:
            return
        self._check_room()
        with self._grad_mode(), self.kernel_choices():
            snap = self.cache.snapshot()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup_steps):
                    self.cache.restore(snap)
                    self._forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.cache.restore(snap)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls meanwhile (a concurrent generate() on transformers' loop)
            # are neither captured nor refused
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = self._forward()
            self.cache.restore(snap)  # capturing ran no kernel, but the host-side token count moved
            del snap
        self.graph, self.static_logits = graph, logits

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` of one more token ``input_ids [B, 1]`` (or ``[B]``), the cache advanced.
        With the graph the result is its output buffer, overwritten by the next step."""
        self._check_room()
        ids = input_ids.reshape(self.batch_size, 1)
        if not self.enabled:
            with self._grad_mode():
                return self.model(input_ids=ids, cache=self.cache).logits
        if self.graph is None:
            self.capture()
        with self._grad_mode():
            self.static_ids.copy_(ids)
        self.graph.replay()
        self.cache.note_tokens(1)  # the replay advanced the device counter; keep the host count with it
        return self.static_logits

    __call__ = step


STOP_CHECK_EVERY = 32


def looks_after(step: int) -> bool:
    """Whether the host looks for finished rows after ``step`` (from 1): after steps 1, 2, 4, 8 and 16, then every
    ``STOP_CHECK_EVERY``. A short answer stops within twice its length, a long one within STOP_CHECK_EVERY - 1
    steps, with a handful of syncs a call."""
    return step % STOP_CHECK_EVERY == 0 or (step < STOP_CHECK_EVERY and step & (step - 1) == 0)
# the new tokens a fast-path call's static cache first has room for; a call that outgrows it continues in one of
# twice the length (never more than the call can fill), so a huge max_new_tokens costs what is generated
CACHE_STEP = 256


class KeptDecoder:
    """The static cache and captured step of a model's last :func:`graphed_generate` call, kept on the model so
    the next call of the same shape skips the cache allocation, the eager warm-up steps and the capture (a cost
    per call that a short generation otherwise pays again every time). One call at a time uses them: ``lock`` is
    held for the whole call (``generate()`` sends a call that finds it held to transformers' loop). A copy or
    pickle of the model gets an empty one: a graph belongs to the buffers it was captured on."""

    def __init__(self):
        self.key: Optional[tuple] = None
        self.decoder: Optional[GraphedDecoder] = None
        self.lock = threading.Lock()

    def __deepcopy__(self, memo):
        return KeptDecoder()

    def __reduce__(self):
        return KeptDecoder, ()

    def busy(self) -> bool:
        """Whether a call is using the kept cache now."""
        return self.lock.locked()

    def release(self) -> None:
        """Drop the cache and graph (the caller holds ``lock``)."""
        self.key = self.decoder = None


def _kept(model) -> KeptDecoder:
    return model.__dict__.setdefault("_kept_decoder", KeptDecoder())


def kept_decoder_busy(model) -> bool:
    """Whether a :func:`graphed_generate` call is using ``model``'s kept static cache now (another thread's)."""
    kept = model.__dict__.get("_kept_decoder")
    return kept is not None and kept.busy()


def _reuse_key(model, batch: int, device, cuda_graph: Optional[bool]) -> tuple:
    """What a kept decoder must share with a new call to serve it: the cache's batch size and kind, the grad mode
    its buffers were made under, and what the captured step baked in (the weights' addresses: a ``model.to()`` or a
    replaced parameter makes new tensors; the model's decode-kernel runtime settings, ``DECODE_RUNTIME_KEYS``)."""
    weights = tuple(t.data_ptr() for t in model.parameters()) + tuple(t.data_ptr() for t in model.buffers())
    runtime = model.config.runtime
    return (batch, model.dtype, str(device), cuda_graph, torch.is_inference_mode_enabled(), model.training,
            tuple(getattr(runtime, key) for key in DECODE_RUNTIME_KEYS), hash(weights))


def kept_decoder(model, batch: int, prompt: int, max_new_tokens: int, device,
                 cuda_graph: Optional[bool]) -> GraphedDecoder:
    """The model's kept decoder, its cache emptied in place, when it fits this call: the same key, room for the
    prompt and the first ``CACHE_STEP`` new tokens (or all of them), and no more positions than the call can fill.
    Else a new one of that first size, kept instead (the old one is dropped first, so its memory can serve the new
    one). The caller holds the kept decoder's lock."""
    kept = _kept(model)
    need = prompt + max_new_tokens - 1  # the positions the cache holds when the last new token is fed
    first = min(need, prompt + CACHE_STEP)
    key = _reuse_key(model, batch, device, cuda_graph)
    if kept.key == key and first <= kept.decoder.cache.max_length <= need:
        kept.decoder.cache.reset()
        return kept.decoder
    kept.release()
    cache = HybridCache(model.config, max_length=first, batch_size=batch, dtype=model.dtype, device=device)
    kept.key, kept.decoder = key, GraphedDecoder(model, cache, enabled=cuda_graph)
    return kept.decoder


def grown_decoder(model, decoder: GraphedDecoder, need: int) -> GraphedDecoder:
    """``decoder``'s generation continued in a static cache of twice the positions (at most ``need``), its contents
    copied, with its own step (captured afresh on CUDA); kept instead of ``decoder``. The caller holds the lock."""
    kept = _kept(model)
    cache = decoder.cache.grown(model.config, min(need, 2 * decoder.cache.max_length))
    key = kept.key
    kept.release()
    kept.key, kept.decoder = key, GraphedDecoder(model, cache, enabled=decoder.enabled)
    return kept.decoder


def release_kept_decoder(model) -> None:
    """Free the static cache and CUDA graph that :func:`graphed_generate` keeps on ``model`` for its next call
    (after the call using them, if one is running)."""
    kept = model.__dict__.get("_kept_decoder")
    if kept is not None:
        with kept.lock:
            kept.release()


def _next_tokens(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: Optional[int],
                 generator: Optional[torch.Generator]) -> torch.Tensor:
    """[B, vocab] logits -> [B] token ids: argmax, or a draw from softmax(logits / temperature) over the top_k."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def _drawn_from(generator: Optional[torch.Generator], device: torch.device) -> Optional[torch.Generator]:
    """The generator ``torch.multinomial`` draws from on ``device``: ``generator``, else the device's default one
    (None on a device other than CPU and CUDA)."""
    if generator is not None:
        return generator
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


@torch.no_grad()
def graphed_generate(model, input_ids: torch.LongTensor, max_new_tokens: int, eos_token_id: Optional[int] = None,
                     pad_token_id: Optional[int] = None, do_sample: bool = False, temperature: float = 1.0,
                     top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                     cuda_graph: Optional[bool] = None) -> torch.LongTensor:
    """``generate()`` through a static cache and one captured decode step: the fast path for small models.

    ``input_ids [B, P]`` are full rows (a static cache takes no padding: batch prompts of one length, or use
    ``model.generate`` with a left-padded batch). Returns ``[B, P + n]``; greedy by default (the tokens of
    ``model.generate(do_sample=False)``), or sampling with ``temperature`` / ``top_k`` / ``generator``.
    With ``eos_token_id``, a row that produced it continues with ``pad_token_id`` (default: the EOS), and
    generation ends once every row has: the host looks after steps 1, 2, 4, 8, 16, then every ``STOP_CHECK_EVERY``
    steps (:func:`looks_after`; one sync each, not one per step), and the result is cut at the last row's EOS, so ``n`` is what ``generate()`` returns. When
    sampling, the generator is left in the state it had after the draw of that step (its state is kept after each
    draw since the last look, a 5 KB copy on CPU, 16 bytes on CUDA), so the draws consumed are those of
    ``generate()``'s loop, which samples once a step until every row has finished.
    The static cache first has room for ``CACHE_STEP`` new tokens and doubles when it fills (on CUDA a step is
    captured for each size), so memory follows the tokens generated, not ``max_new_tokens``.
    ``cuda_graph``: None = on CUDA. The static cache and the captured step stay on the model for the next call
    of the same batch size that fits them (:func:`kept_decoder`; :func:`release_kept_decoder` frees them); a
    second call meanwhile (another thread) waits for them.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    args = (model, input_ids, max_new_tokens, eos_token_id, pad_token_id, do_sample, temperature, top_k, generator,
            cuda_graph)
    if max_new_tokens == 1:  # the prompt's token only: a cache of the prompt's length, not kept
        return _generate(*args)
    with _kept(model).lock:  # a decode follows: the model's kept cache and graph, one call at a time
        return _generate(*args)


def _generate(model, input_ids, max_new_tokens, eos_token_id, pad_token_id, do_sample, temperature, top_k,
              generator, cuda_graph) -> torch.LongTensor:
    B, P = input_ids.shape
    device = input_ids.device
    need = P + max_new_tokens - 1  # the cache's positions when the last new token is fed
    if max_new_tokens > 1:
        decoder = kept_decoder(model, B, P, max_new_tokens, device, cuda_graph)
        cache = decoder.cache
    else:
        cache = HybridCache(model.config, max_length=P, batch_size=B, dtype=model.dtype, device=device)
        decoder = None
    logits = model(input_ids=input_ids, cache=cache, logits_to_keep=1).logits[:, -1]
    tokens = []  # [B] each; grown a step at a time (no buffer of max_new_tokens)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    pad = eos_token_id if pad_token_id is None else pad_token_id
    # sampling that can stop early draws past the last EOS until the next look: the generator's state after each
    # draw since the last look is kept, to rewind to the draw of the step where the last row finished
    drawn = _drawn_from(generator, device) if do_sample and eos_token_id is not None and max_new_tokens > 1 else None
    states, looked = [], 0  # states[j]: the state after the draw of step looked + j (0-based)
    for i in range(max_new_tokens):
        nxt = _next_tokens(logits, do_sample, temperature, top_k, generator)
        if drawn is not None:
            states.append(drawn.get_state())
        if eos_token_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            finished |= nxt == eos_token_id
        tokens.append(nxt)
        # a host sync at a few steps, not every step, to stop soon after the last EOS
        if eos_token_id is not None and looks_after(i + 1):
            if bool(finished.all()):
                break
            states, looked = [], i + 1  # a row is unfinished at step i: the loop draws on past it
        if i + 1 < max_new_tokens:
            if decoder.cache.get_seq_length() == decoder.cache.max_length:  # full: continue in a longer one
                decoder = grown_decoder(model, decoder, need)
            logits = decoder.step(nxt)[:, -1]
    out = torch.stack(tokens, dim=1)
    if eos_token_id is not None and bool(finished.all()):
        # generate() stops at the step where the last row finished: cut there
        last = int((out == eos_token_id).int().argmax(1).max().item())
        out = out[:, :last + 1]
        if drawn is not None:  # and has drawn last + 1 times
            drawn.set_state(states[last - looked])
    return torch.cat([input_ids, out], dim=1)
