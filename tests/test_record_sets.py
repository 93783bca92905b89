"""The route's SFT, preference and web-text data: real record files from the pinned PyPI sdist of llamafactory,
checked by sha256 when fetched and on every use, loaded by name (``asset:alpaca_en_demo``) wherever a data file
is accepted."""
import json

import pytest

from conftest import demo_file
from distill.preference_data import load_preference_data
from hybridlm.data import record_sets
from hybridlm.data.assets import asset_names, resolve_source
from hybridlm.data.cache import AssetError
from hybridlm.data.sft import load_sft_data
from hybridlm.utils.digest import sha256_of


def test_record_files_are_real_and_match_their_pins():
    sft = json.loads(demo_file("alpaca_en_demo.json").read_text(encoding="utf-8"))
    pairs = json.loads(demo_file("dpo_en_demo.json").read_text(encoding="utf-8"))
    web = [json.loads(line) for line in demo_file("c4_demo.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(sft) == 999 and {"instruction", "output"} <= set(sft[0])
    assert len(pairs) == 300 and {"conversations", "chosen", "rejected"} <= set(pairs[0])
    assert len(web) == 300 and sum(len(d["text"].split()) for d in web) > 100_000  # ~370 words a document
    for rec in record_sets.RECORD_SETS.values():
        assert sha256_of(record_sets.record_file(rec.name)) == rec.sha256


def test_asset_names_load_where_a_data_file_is_accepted():
    assert {"alpaca_en_demo", "dpo_en_demo", "c4_demo"} <= set(asset_names())
    assert resolve_source("asset:dpo_en_demo") == str(demo_file("dpo_en_demo.json"))
    assert len(load_sft_data("asset:alpaca_en_demo")) == 999
    pairs = load_preference_data("asset:dpo_en_demo")
    assert len(pairs) == 300 and pairs[0].chosen != pairs[0].rejected


def test_a_file_changed_in_the_cache_is_refetched(tmp_path, monkeypatch):
    """Same size, other bytes: caught by its digest, and the pinned file comes back."""
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path))
    path = record_sets.record_file("dpo_en_demo")
    data = bytearray(path.read_bytes())
    data[1000:1064] = b"x" * 64
    path.write_bytes(bytes(data))
    assert sha256_of(path) != record_sets.RECORD_SETS["dpo_en_demo"].sha256
    again = record_sets.record_file("dpo_en_demo")
    assert sha256_of(again) == record_sets.RECORD_SETS["dpo_en_demo"].sha256


def test_a_member_that_does_not_match_its_pin_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path))
    good = record_sets.RECORD_SETS["c4_demo"]
    monkeypatch.setitem(record_sets.RECORD_SETS, "c4_demo", record_sets.RecordSet(
        good.name, good.what, good.member, "0" * 64))
    with pytest.raises(AssetError, match=r"asset:c4_demo fetch: .*c4_demo\.jsonl .* has sha256 f5152808.*expected the "
                                         r"pinned 0{64}"):
        record_sets.record_file("c4_demo")
    assert not any(p.name.endswith(".jsonl") for p in tmp_path.rglob("*")), "nothing half-built is left"
