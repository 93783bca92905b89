"""Teacher-sampled data (distill/teacher_samples.py): prompts from a prepared dataset's document starts, the same
shards for the same seed, a cut run resumed to the same bytes, a changed teacher or setting refused, and the
samples mixed into a prepared dataset by weight. A tiny random Llama with the real Llama-3.2 tokenizer is the
teacher; the prompts are the alpaca demo records."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import save_tiny_llama, subprocess_env
from distill.teacher_samples import (MANIFEST, SampleConfig, batch_prompts, finished_record, prompt_starts, sample,
                                     shard_name)
from hybridlm.config.errors import ConfigError
from hybridlm.data import PackedTokens, load_tokenizer, prepare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("teacher") / "llama", num_layers=2))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "alpaca"
    prepare(["asset:alpaca_en_demo"], "asset:llama3.2", out, progress=False)
    return str(out)


def _cfg(prompts, out, **kw) -> SampleConfig:
    base = dict(prompts=prompts, out=str(out), tokens=3 * 6 * 3, prompt_len=8, gen_len=6, batch_size=3, seed=11,
                cache="dynamic", top_p=0.9)
    base.update(kw)
    return SampleConfig(**base)


def _shards(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard_*.jsonl"))}


def test_prompt_starts_are_document_starts_longer_than_the_prompt():
    eos = 9
    tokens = np.array([1, 2, 3, 9, 4, 9, 5, 6, 7, 8, 9, 1, 2], dtype=np.int64)
    # documents start at 0, 4, 6, 11; the one at 4 has 1 token, the one at 11 runs to the end with 2
    assert prompt_starts(tokens, eos, 2).tolist() == [0, 6, 11]
    assert prompt_starts(tokens, eos, 3).tolist() == [0, 6]
    assert prompt_starts(tokens, eos, 5).tolist() == []


def test_samples_are_seeded_continuations_of_document_starts(teacher, prompts, tmp_path):
    cfg = _cfg(prompts, tmp_path / "a")
    summary = sample(cfg, teacher, progress=False)
    assert summary["complete"] and summary["shards"] == 3 and summary["rows"] == 9
    assert 0 < summary["new_tokens"] <= 9 * 6 and summary["new_tokens_per_second"] > 0
    assert json.loads((tmp_path / "a" / MANIFEST).read_text())["settings"]["seed"] == 11
    # every prompt is the first prompt_len tokens of a training document of the prompts' dataset
    tok = load_tokenizer("asset:llama3.2")
    train = PackedTokens(prompts, "train")[:]
    starts = prompt_starts(train, tok.eos_token_id, cfg.prompt_len)
    firsts = {tuple(train[s: s + cfg.prompt_len]) for s in starts}
    rows = [json.loads(line) for p in sorted((tmp_path / "a").glob("shard_*.jsonl")) for line in p.open()]
    assert len(rows) == 9
    for r, b in zip(rows, [0] * 3 + [1] * 3 + [2] * 3):
        assert r["prompt_tokens"] == cfg.prompt_len and 0 <= r["new_tokens"] <= cfg.gen_len
    for b in range(3):
        assert all(tuple(row.tolist()) in firsts for row in batch_prompts(train, starts, cfg, b))
    prompt_text = tok.decode(batch_prompts(train, starts, cfg, 0)[0].tolist())
    assert rows[0]["text"].startswith(prompt_text)
    # the same seed writes the same bytes; another seed other prompts and draws
    sample(_cfg(prompts, tmp_path / "b"), teacher, progress=False)
    assert _shards(tmp_path / "a") == _shards(tmp_path / "b")
    sample(_cfg(prompts, tmp_path / "c", seed=12), teacher, progress=False)
    assert _shards(tmp_path / "c") != _shards(tmp_path / "a")


def test_a_cut_run_resumes_to_the_same_bytes(teacher, prompts, tmp_path):
    """Two shards written, the third cut while being written (its file there, no record), the second's bytes
    damaged at the same size: the rerun redoes exactly those two and matches an uninterrupted run; a larger
    ``tokens`` only adds shards."""
    full = tmp_path / "full"
    sample(_cfg(prompts, full), teacher, progress=False)
    cut = tmp_path / "cut"
    sample(_cfg(prompts, cut, tokens=2 * 18), teacher, progress=False)
    assert sorted(_shards(cut)) == [shard_name(0), shard_name(1)]
    (cut / shard_name(2)).write_text('{"text": "half a li')  # a shard whose record was never written
    damaged = bytearray((cut / shard_name(1)).read_bytes())
    damaged[2] ^= 1
    (cut / shard_name(1)).write_bytes(bytes(damaged))
    assert finished_record(cut, 1) is None and finished_record(cut, 0) is not None
    first_mtime = (cut / shard_name(0)).stat().st_mtime_ns
    summary = sample(_cfg(prompts, cut), teacher, progress=False)
    assert _shards(cut) == _shards(full) and summary["shards"] == 3
    assert (cut / shard_name(0)).stat().st_mtime_ns == first_mtime  # a finished shard is not redone
    more = sample(_cfg(prompts, cut, tokens=5 * 18), teacher, progress=False)
    assert more["shards"] == 5 and all(_shards(cut)[k] == v for k, v in _shards(full).items())


def test_another_teacher_or_setting_is_refused(teacher, prompts, tmp_path):
    out = tmp_path / "s"
    sample(_cfg(prompts, out, tokens=18), teacher, progress=False)
    before = _shards(out)
    with pytest.raises(ConfigError, match=r"^sample\.temperature: .* temperature=1\.0, not 0\.7"):
        sample(_cfg(prompts, out, tokens=18, temperature=0.7), teacher, progress=False)
    other = save_tiny_llama(tmp_path / "other", num_layers=3)
    with pytest.raises(ConfigError, match=r"^sample\.out: .* holds samples of teacher .*sha256"):
        sample(_cfg(prompts, out, tokens=18), str(other), progress=False)
    assert _shards(out) == before  # nothing lost
    with pytest.raises(ConfigError, match=r"sample\.prompts: .*meta\.json does not exist"):
        sample(_cfg(str(tmp_path / "nowhere"), tmp_path / "t"), teacher, progress=False)


def test_a_rerun_reads_each_file_once_and_sees_a_teacher_replaced_in_place(teacher, prompts, tmp_path, monkeypatch):
    """A finished rerun hashes each shard once and not the teacher's weights (their name, size and mtime are those
    recorded); weights rewritten under the same path are hashed again and refused."""
    import shutil
    import distill.teacher_samples as ts
    mine = tmp_path / "teacher"
    shutil.copytree(teacher, mine)
    out = tmp_path / "s"
    sample(_cfg(prompts, out), str(mine), progress=False)
    read = []
    real = ts.sha256_of
    monkeypatch.setattr(ts, "sha256_of", lambda path: read.append(os.path.basename(path)) or real(path))
    again = sample(_cfg(prompts, out), str(mine), progress=False)
    assert again["complete"] and sorted(read) == [shard_name(b) for b in range(3)]
    weights = mine / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the same size, other weights
    weights.write_bytes(bytes(data))
    read.clear()
    with pytest.raises(ConfigError, match=r"^sample\.out: .* holds samples of teacher .*sha256"):
        sample(_cfg(prompts, out), str(mine), progress=False)
    assert "model.safetensors" in read


@pytest.mark.slow  # ~50 s on 2 cores (a second prepare); the route's levers test mixes samples by weight too
def test_samples_mix_into_a_prepared_dataset_by_weight(teacher, prompts, tmp_path):
    out = tmp_path / "s"
    sample(_cfg(prompts, out), teacher, progress=False)
    texts = [json.loads(line)["text"] for p in sorted(out.glob("shard_*.jsonl")) for line in p.open()]
    meta = prepare(["asset:alpaca_en_demo", {"source": str(out), "weight": 2}], "asset:llama3.2", tmp_path / "mix",
                   val_fraction=0.1, progress=False)
    counts = meta["sources"]
    assert counts[1]["num_docs"] == len(texts)  # the shards' rows, not the hidden records
    assert meta["params"]["sources"][1] == {"source": str(out.resolve()), "weight": 2.0}


@pytest.mark.slow  # three processes that import torch, transformers and DeepSpeed
def test_the_cli_writes_and_reuses_the_samples(teacher, prompts, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "upcycle.cli", "sample", "--teacher", teacher, "--prompts", prompts, "--out", str(out),
           "--tokens", "36", "--gen-len", "6", "--batch-size", "3", "--prompt-len", "8", "--cache", "dynamic"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "teacher samples: 6 continuations" in first.stdout and "tokens/s" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=300)
    assert again.returncode == 0 and "teacher samples: 6 continuations" in again.stdout
    bad = subprocess.run(cmd[:-2] + ["--temperature", "0.5"], capture_output=True, text=True, env=subprocess_env(),
                         cwd=REPO, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("error: sample.temperature:")
