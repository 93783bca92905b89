"""The one epoch / shuffle / rank-sharding / resume policy behind every training batch stream."""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from hybridlm.config.errors import ConfigError


def check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{name}: expected an integer >= {low}, got {value!r}")


def validation_indices(num_items: int, micro_batch_size: int, max_batches: int, rank: int, world_size: int,
                       too_few: str) -> List[np.ndarray]:
    """The one validation policy: at most ``max_batches`` batches of the leading items, in order, the same on
    every call; the ranks share each global batch, and with few items the per-rank batch shrinks so every rank
    gets the same number (>= 1) of equal-sized batches. ``too_few`` is the error when there is not even one
    item per rank. Returns each batch's item indices for this rank."""
    check_int("micro_batch_size", micro_batch_size, 1)
    check_int("max_batches", max_batches, 1)
    check_int("world_size", world_size, 1)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
    if num_items < world_size:
        raise ConfigError(too_few)
    mbs = min(micro_batch_size, num_items // world_size)
    g = mbs * world_size
    n = min(max_batches, num_items // g)
    return [np.arange(b * g + rank, (b + 1) * g, world_size) for b in range(n)]


class ShuffledBatches:
    """Endless, resumable, rank-sharded batches over ``num_items`` items (windows, examples, pairs).

    Each epoch visits the items in a permutation seeded by ``(seed, epoch)``; consecutive runs of
    ``micro_batch_size * world_size`` items form a global batch and rank ``r`` takes its entries
    ``r, r + world_size, ...``. The tail that does not fill a global batch is skipped that epoch (a
    different tail each epoch). ``state_dict`` is (epoch, items consumed) plus what identifies the data,
    so a resumed run sees exactly the batches an uninterrupted one would, even with another world size.
    Subclasses provide :meth:`make_batch` and, in :meth:`identity`, the values a saved state must match.
    """

    resume_hint = "resume with the same data and seed"

    def __init__(self, num_items: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 too_few: str):
        check_int("micro_batch_size", micro_batch_size, 1)
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0)
        check_int("seed", seed, 0)
        if rank >= world_size:
            raise ConfigError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
        self.micro_batch_size, self.rank, self.world_size, self.seed = micro_batch_size, rank, world_size, seed
        self.num_items = num_items
        self.global_batch = micro_batch_size * world_size
        self.steps_per_epoch = num_items // self.global_batch
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{too_few}, fewer than one global batch of micro_batch_size * world_size = "
                              f"{self.global_batch}")
        self.epoch = 0
        self.position = 0  # items of the current epoch's order already handed out (all ranks together)
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def make_batch(self, indices: np.ndarray) -> Dict[str, Any]:
        raise NotImplementedError

    def identity(self) -> Dict[str, Any]:
        return {"seed": self.seed}

    def order(self, epoch: int) -> np.ndarray:
        """The item permutation of ``epoch`` (same on every rank)."""
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> "ShuffledBatches":
        return self

    def __next__(self) -> Dict[str, Any]:
        if self.position + self.global_batch > self.steps_per_epoch * self.global_batch:
            self.epoch, self.position = self.epoch + 1, 0
        chunk = self.order(self.epoch)[self.position:self.position + self.global_batch]
        self.position += self.global_batch
        return self.make_batch(chunk[self.rank::self.world_size])

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, **self.identity()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue where ``state`` left off; the data must be what it was saved with."""
        for key, value in self.identity().items():
            if key in state and state[key] != value:
                raise ConfigError(f"data state: saved {key} = {state[key]!r}, but now {value!r} ({self.resume_hint})")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_items:
            raise ConfigError(f"data state: epoch {epoch} / position {position} out of range")
        self.epoch, self.position = epoch, position

