"""The shared demo data the tests need is there, and a missing file fails a test (with its path) instead of
skipping it: a clean clone without ../shared/data cannot pass by leaving the ILD / KD / DPO / route tests out."""
import json

import pytest

from conftest import SHARED_DATA, shared_file


def test_missing_shared_file_fails_naming_it():
    with pytest.raises(pytest.fail.Exception, match=r"no_such_file\.json is missing"):
        shared_file("no_such_file.json")


def test_demo_data_present_and_real():
    sft = json.loads(shared_file("alpaca_en_demo.json").read_text(encoding="utf-8"))
    pairs = json.loads(shared_file("dpo_en_demo.json").read_text(encoding="utf-8"))
    assert len(sft) == 999 and {"instruction", "output"} <= set(sft[0])
    assert len(pairs) == 300 and {"conversations", "chosen", "rejected"} <= set(pairs[0])
    assert shared_file("alpaca_en_demo.json").parent == SHARED_DATA
