"""Reading a few device values on the host without waiting for the work launched after them.

``tensor.tolist()`` on a GPU copies in stream order: it waits for every kernel launched so far, so a loop that
reads step ``k``'s loss after launching step ``k + 1`` would wait for step ``k + 1`` too. A :class:`Readback`
starts the copy into pinned host memory when it is made and records a CUDA event behind it; ``tolist()``
waits for that event only. A training loop can then launch the next step before it reads this one's values,
and the GPU has work queued while the host is busy (docs/design.md, "Reading a step's results one step late").
"""
from __future__ import annotations

import time
from typing import List, Optional

import torch


class Readback:
    """The values of a small tensor as they are when this is made, read later with :meth:`tolist`."""

    def __init__(self, values: torch.Tensor):
        values = values.detach()
        self._event: Optional[torch.cuda.Event] = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            # a copy, so that later in-place work on ``values`` cannot change what is read
            self._host = values.to("cpu", copy=True)
        self._list: Optional[List[float]] = None

    def ready(self) -> bool:
        """Whether :meth:`tolist` would return without waiting."""
        return self._list is not None or self._event is None or self._event.query()

    def tolist(self) -> List[float]:
        """The values (waits for the work launched before this was made, not for the work since)."""
        if self._list is None:
            if self._event is not None:
                self._event.synchronize()
            self._list = self._host.tolist()
        return self._list


class Stamp:
    """A point in the device's timeline: a timing CUDA event on a GPU, the host's clock on a CPU (where the work
    has run when the host gets past it). ``seconds_since(earlier)`` is the device time between the two, once the
    work before this stamp is done (as it is when a Readback made after it has been read)."""

    def __init__(self, device: torch.device):
        self._event: Optional[torch.cuda.Event] = None
        if device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        self._host = time.perf_counter()

    def seconds_since(self, earlier: "Stamp") -> float:
        if self._event is not None and earlier._event is not None:
            return earlier._event.elapsed_time(self._event) / 1e3
        return self._host - earlier._host
