"""``upcycle run`` checks every input it will read before its first stage: a missing teacher, data source or
preference file is one ``error:`` line naming the key, and nothing is written."""
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, save_tiny_llama, subprocess_env
from hybridlm.config.errors import ConfigError
from upcycle.route import run_route

ROUTE_CPU = REPO / "configs" / "upcycle" / "smollm2_route_cpu.yaml"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("route_inputs") / "teacher")


def route_config(tmp_path, teacher_dir, changes):
    cfg = yaml.safe_load(ROUTE_CPU.read_text(encoding="utf-8"))
    cfg["output_dir"], cfg["teacher"] = str(tmp_path / "route"), str(teacher_dir)
    cfg["ild"]["data"]["path"] = str(tmp_path / "ild_data")
    for key, value in changes.items():
        node = cfg
        *parents, last = key.split(".")
        for k in parents:
            node = node[k]
        node[last] = value
    return cfg


@pytest.mark.parametrize("key, value, message", [
    ("teacher", "no/such/teacher", r"^teacher: 'no/such/teacher' is not a transformers model directory .* does not "
                                   r"exist$"),
    ("teacher", "asset:gpt5", r"^teacher: 'asset:gpt5' is not a known teacher asset"),
    ("ild.data.sources", ["asset:alpaca_en_demo", "missing_corpus/"], r"^ild\.data\.sources\[1\]: 'missing_corpus/' "
                                                                     r"does not exist$"),
    ("ild.data.sources", ["asset:alpaca_en_dem"], r"^ild\.data\.sources\[0\]: unknown asset 'asset:alpaca_en_dem'"),
    ("kd.data.path", "no_sft.json", r"^kd\.data\.path: 'no_sft\.json' does not exist$"),
    ("dpo.data.path", "no_pairs.json", r"^dpo\.data\.path: 'no_pairs\.json' does not exist$"),
    ("dpo.data.path", "configs", r"^dpo\.data\.path: 'configs' is not a file"),
    ("report", {"heldout_sources": ["asset:nope"]}, r"^report\.heldout_sources\[0\]: unknown asset 'asset:nope'"),
])
def test_a_missing_input_is_refused_before_the_first_stage(tmp_path, teacher, monkeypatch, key, value, message):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=message):
        run_route(route_config(tmp_path, teacher, {key: value}))
    assert not (tmp_path / "route").exists() and not (tmp_path / "ild_data").exists()


def test_the_cli_answers_one_line_and_status_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "upcycle.cli", "run", "--config", str(ROUTE_CPU),
                          f"output_dir={tmp_path / 'route'}", "dpo.data.path=missing_pairs.json"],
                         cwd=REPO, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == ["error: dpo.data.path: 'missing_pairs.json' does not exist"]
    assert not (tmp_path / "route").exists()
