"""The batch prefetcher (hybridlm/data/prefetch.py): same batches, exact resume state, errors where they belong."""
import threading

import pytest
import torch

from hybridlm.data.prefetch import Prefetcher
from hybridlm.data.sampler import ShuffledBatches


class Items(ShuffledBatches):
    """The project's sampler over 10 numbered items; ``bad`` makes the batch holding that item fail."""

    def __init__(self, bad=None):
        super().__init__(10, 2, 0, 1, seed=3, too_few="too few")
        self.bad = bad

    def make_batch(self, indices):
        if self.bad is not None and self.bad in indices:
            raise ValueError(f"corrupt shard at item {self.bad}")
        return {"input_ids": torch.as_tensor(indices)}


def test_same_batches_and_the_state_of_the_batches_taken():
    plain = Items()
    expected, states = [], []
    for _ in range(7):  # across an epoch boundary (5 batches an epoch)
        expected.append(next(plain)["input_ids"])
        states.append(plain.state_dict())
    wrapped = Items()
    with Prefetcher(wrapped) as pf:
        for k in range(7):
            assert torch.equal(next(pf)["input_ids"], expected[k])
            assert pf.state_dict() == states[k]
    # closed: the wrapped stream is where the batches taken left it, not one batch ahead
    assert wrapped.state_dict() == states[6]
    assert torch.equal(next(wrapped)["input_ids"], next(plain)["input_ids"])


def test_resuming_from_its_state_continues_the_stream():
    first = Items()
    with Prefetcher(first) as pf:
        taken = [next(pf)["input_ids"] for _ in range(3)]
        saved = pf.state_dict()
    resumed = Items()
    resumed.load_state_dict(saved)
    reference = Items()
    for _ in range(3):
        next(reference)
    with Prefetcher(resumed) as pf:
        assert [next(pf)["input_ids"].tolist() for _ in range(4)] == [next(reference)["input_ids"].tolist()
                                                                      for _ in range(4)]
    assert len(taken) == 3


def test_batches_are_made_when_asked_for():
    stream = Items()
    with Prefetcher(stream) as pf:
        assert pf._queue.qsize() == 0 and stream.state_dict()["position"] == 0  # nothing made unasked
        first = next(pf)  # nothing asked: next() asks for this one itself
        pf.request(2)
        for _ in range(100):
            if pf._queue.qsize() == 2:
                break
            threading.Event().wait(0.01)
        assert pf._queue.qsize() == 2 and stream.state_dict()["position"] == 6  # made ahead, not yet taken
        assert pf.state_dict()["position"] == 2
        assert [next(pf)["input_ids"].tolist() for _ in range(3)] == [
            Items().order(0)[k:k + 2].tolist() for k in (2, 4, 6)]  # two asked for, the third asked by next()
        assert first["input_ids"].tolist() == Items().order(0)[:2].tolist()
    assert stream.state_dict()["position"] == 8


def test_an_error_arrives_with_the_batch_that_failed():
    order = Items().order(0)
    bad = int(order[4])  # in the third batch
    with Prefetcher(Items(bad=bad)) as pf:
        next(pf), next(pf)
        with pytest.raises(ValueError, match=f"corrupt shard at item {bad}"):
            next(pf)
        with pytest.raises(ValueError, match="corrupt shard"):  # and again, not a hang
            next(pf)
    pf.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        next(pf)


def test_one_walk_over_the_tensors_of_a_batch():
    from collections import namedtuple

    from hybridlm.utils.tensors import map_tensors
    Pair = namedtuple("Pair", "a b")
    batch = {"ids": torch.ones(2), "more": [torch.zeros(1), (torch.ones(1), "tag")], "pair": Pair(torch.ones(1), 3)}
    out = map_tensors(lambda t: t + 1, batch)
    assert torch.equal(out["ids"], torch.full((2,), 2.0)) and torch.equal(out["more"][0], torch.ones(1))
    assert isinstance(out["more"][1], tuple) and out["more"][1][1] == "tag"
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].a, torch.full((1,), 2.0)) and out["pair"].b == 3
