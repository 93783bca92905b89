"""In-document windows for a long-context stage: every window is a slice of one document (EOS only as its last
token), each long-enough document gives ``len // (seq_len + 1)`` of them, shorter ones none; KD's
``data.format: documents`` trains on them."""
import numpy as np
import pytest
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.data import PackedTokens, prepare, tokenizer_path
from hybridlm.data.document_windows import (DocumentDataConfig, DocumentWindows, document_spans,
                                            document_validation_batches, open_document_splits)
from distill.kd import kd_configs, kd_data

SEQ = 48


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Documents of 5 to ~400 tokens (Llama-3.2 tokenizer): many too short for a window, a few holding several."""
    root = tmp_path_factory.mktemp("docs")
    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        words = int(rng.choice([3, 10, 30, 120, 300]))
        (src / f"doc{i:02d}.txt").write_text(" ".join(f"d{i}w{j}" for j in range(words)) + ".")
    out = root / "packed"
    prepare([str(src)], str(tokenizer_path()), out, val_fraction=0.25, progress=False)
    return out


def test_windows_lie_inside_one_document(packed):
    tokens = PackedTokens(packed, "train")
    spans = document_spans(tokens)
    stream = tokens.read(0, len(tokens))
    assert spans[0, 0] == 0 and spans[-1, 1] == len(tokens) and (spans[1:, 0] == spans[:-1, 1]).all()
    assert all(stream[e - 1] == tokens.eos_id for _, e in spans)  # each span ends with its EOS
    assert sum(stream == tokens.eos_id) == len(spans) == tokens.num_docs
    data = DocumentWindows(tokens, SEQ, micro_batch_size=2)
    lengths = spans[:, 1] - spans[:, 0]
    assert len(data.starts) == sum(lengths // (SEQ + 1)) > 0
    assert 0 < sum(lengths >= SEQ + 1) < len(spans)  # the fixture has short documents to leave out
    for s in data.starts:
        doc = np.searchsorted(spans[:, 0], s, side="right") - 1
        assert s + SEQ + 1 <= spans[doc, 1], "a window crosses its document's end"
        assert (stream[s:s + SEQ] != tokens.eos_id).all()
    seen = set()
    for _ in range(data.steps_per_epoch):  # one epoch visits every window once, each as its document holds it
        batch = next(data)
        assert batch["input_ids"].shape == (2, SEQ)
        assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
        for row in batch["input_ids"]:
            seen.add(tuple(row.tolist()))
    assert len(seen) == data.steps_per_epoch * 2


def test_windows_resume_where_they_stopped(packed):
    tokens = PackedTokens(packed, "train")
    a = DocumentWindows(tokens, SEQ, 2, seed=3)
    next(a), next(a)
    state = a.state_dict()
    want = next(a)
    b = DocumentWindows(tokens, SEQ, 2, seed=3)
    b.load_state_dict(state)
    assert torch.equal(next(b)["input_ids"], want["input_ids"])
    other = DocumentWindows(tokens, SEQ + 1, 2, seed=3)
    with pytest.raises(ConfigError):
        other.load_state_dict(state)


def test_validation_and_errors(packed):
    val = document_validation_batches(PackedTokens(packed, "val"), SEQ, 2, 3)
    assert 1 <= len(val) <= 3 and all(b["input_ids"].shape[1] == SEQ for b in val)
    train, val2 = open_document_splits(packed, SEQ, 2, 3)
    assert [torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(val, val2)] == [True] * len(val)
    with pytest.raises(ConfigError, match=r"no document has seq_len \+ 1 = 5001 tokens \(the longest of its"):
        DocumentWindows(PackedTokens(packed, "train"), 5000, 2)


def test_kd_format_documents_builds_and_batches(packed):
    cls, section = kd_data({"format": "documents", "path": str(packed), "seq_len": SEQ})
    assert cls is DocumentDataConfig and "format" not in section
    configs = kd_configs({"student": {"path": "s"}, "data": {"format": "documents", "path": str(packed),
                                                             "seq_len": SEQ, "val_max_batches": 2},
                          "optim": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 1, "lr": 1e-4}})
    assert isinstance(configs["data"], DocumentDataConfig)
    with pytest.raises(ConfigError, match="kd.data.format: 'books' is not one of chat, packed, documents"):
        kd_data({"format": "books"})
