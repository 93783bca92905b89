"""The next training batch made on a background thread while the GPU runs the current step.

A batch stream's ``next()`` (reading the token shards, stacking the windows) runs on the host between two steps,
while the GPU waits for the next forward, every step (BENCHMARKS.md, "Training step breakdown").
:class:`Prefetcher` makes the next batches on a thread and, on a CUDA run, copies them into pinned memory, so
that the engine's host-to-device copy does not wait either.

When the thread runs matters: Python threads share one interpreter lock, and a batch made while the step's forward
is being launched slows those launches down, which the GPU then waits for. So the thread makes batches when asked
(:meth:`Prefetcher.request`): the training loop asks for the next step's batches once the backward is launched
(``Engine.train_step(..., before_optimizer_step=...)``), when the host is about to wait for the GPU anyway.
``next()`` with nothing asked for asks for one batch itself, so a caller that never asks still gets every batch.

Resuming stays exact: each batch is handed out with the stream's state right after it was made, and
:meth:`Prefetcher.state_dict` is the state after the last batch handed out, not after those made ahead.
:meth:`Prefetcher.close` puts that state back into the wrapped stream.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Dict, Optional

from hybridlm.utils.tensors import map_tensors

_POLL_S = 0.1


def pinned(obj: Any) -> Any:
    """``obj`` with every CPU tensor in it copied into page-locked memory."""
    return map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" else t, obj)


class Prefetcher:
    """Wraps a resumable batch stream (``__next__``, ``state_dict``, ``load_state_dict``); makes the batches asked
    for (:meth:`request`) ahead of their ``next()``."""

    def __init__(self, batches, pin_memory: bool = False):
        self.batches = batches
        self.pin_memory = pin_memory
        self._state: Dict[str, Any] = batches.state_dict()  # after the batches handed out so far
        self._queue: "queue.Queue" = queue.Queue()
        self._permits = threading.Semaphore(0)  # batches the thread may make before it is asked again
        self._asked = self._taken = 0
        self._failed: Optional[BaseException] = None  # the stream's error: raised again by every later next()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = threading.Thread(target=self._work, name="batch-prefetch",
                                                                    daemon=True)
        self._thread.start()

    def request(self, n: int = 1) -> None:
        """Let the thread make ``n`` more batches now."""
        self._asked += n
        self._permits.release(n)

    def _work(self) -> None:
        while not self._stop.is_set():
            if not self._permits.acquire(timeout=_POLL_S):
                continue
            try:
                batch = next(self.batches)
                item = (pinned(batch) if self.pin_memory else batch, self.batches.state_dict(), None)
            except BaseException as e:  # a corrupt shard, StopIteration: raised where the batch is asked for
                item = (None, None, e)
            self._queue.put(item)
            if item[2] is not None:
                return

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self._thread is None:
            raise RuntimeError("Prefetcher: next() after close()")
        if self._failed is not None:
            raise self._failed
        if self._asked == self._taken:
            self.request(1)
        batch, state, error = self._queue.get()
        self._taken += 1
        if error is not None:
            self._failed = error
            raise error
        self._state = state
        return batch

    def state_dict(self) -> Dict[str, Any]:
        return dict(self._state)

    def close(self) -> None:
        """Stop the thread, drop the batch made ahead and leave the wrapped stream where this one was."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.batches.load_state_dict(self._state)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
