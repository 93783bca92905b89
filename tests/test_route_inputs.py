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


KD_MIX = {"format": "packed", "path": "kd_mix", "seq_len": 64, "tokenizer": "teacher"}


@pytest.mark.parametrize("sample, sources, message", [
    # the samples directory does not exist yet: the route's sample stage writes it before KD
    ({"tokens": 100}, ["asset:alpaca_en_demo", {"source": "ROUTE/samples", "weight": 2}], None),
    ({"tokens": 100, "out": "ROOT/mine"}, ["asset:alpaca_en_demo", {"source": "ROOT/mine", "weight": 0.5}], None),
    # without a sample section, or naming another folder, it is a missing source
    (None, [{"source": "ROUTE/samples", "weight": 2}], r"^kd\.data\.sources\[0\]: '.*samples' does not exist$"),
    ({"tokens": 100}, ["asset:alpaca_en_demo", "ROUTE/sampels"], r"^kd\.data\.sources\[1\]: '.*sampels' does not"),
    ({"tokens": 100, "top_p": 1.5}, ["asset:alpaca_en_demo"], r"^sample\.top_p: expected a number in \(0, 1\]"),
    ({"tokens": 100, "topp": 0.9}, ["asset:alpaca_en_demo"], r"^sample: unknown key 'topp'"),
    ({"tokens": 100}, ["asset:alpaca_en_demo", {"source": "ROUTE/samples", "weight": -1}],
     r"^kd\.data\.sources\[1\]\.weight: expected a number in \(0, 1000\]"),
])
def test_the_sample_section_and_the_kd_mix_naming_it_are_checked_first(tmp_path, teacher, monkeypatch, sample,
                                                                       sources, message):
    """A KD mix may name the samples the route writes before KD; anything else it names must exist, and the
    sample section is checked with the rest, before the first stage."""
    import upcycle.route as route
    monkeypatch.chdir(tmp_path)

    def fill(v):
        return v.replace("ROUTE", str(tmp_path / "route")).replace("ROOT", str(tmp_path)) if isinstance(v, str) else \
            {k: fill(x) for k, x in v.items()} if isinstance(v, dict) else v

    changes = {"kd.data": dict(KD_MIX, sources=[fill(s) for s in sources])}
    if sample is not None:
        changes["sample"] = fill(sample)
    cfg = route_config(tmp_path, teacher, changes)
    started = []
    monkeypatch.setattr(route, "_run_stages", lambda *args: started.append(args[-1]))
    if message is None:
        run_route(cfg)
        assert started and started[0].out == fill(sample.get("out", "ROUTE/samples"))
        assert started[0].prompts == str(tmp_path / "ild_data")  # the ILD data by default
    else:
        with pytest.raises(ConfigError, match=message):
            run_route(cfg)
        assert not started and not (tmp_path / "route").exists()


def test_a_kd_mix_beside_ild_data_split_the_old_way_is_refused(tmp_path, teacher, monkeypatch):
    """ILD data prepared by a version that split the whole mix at once (no ``split`` rule in meta.json): a KD mix of
    its sources plus samples could train on the report's held-out text, so the route refuses before stage 1."""
    import json as _json
    import upcycle.route as route
    monkeypatch.chdir(tmp_path)
    cfg = route_config(tmp_path, teacher, {"kd.data": dict(KD_MIX, sources=["asset:alpaca_en_demo"])})
    ild = tmp_path / "ild_data"
    ild.mkdir()
    (ild / "meta.json").write_text(_json.dumps({"params": {"sources": ["x"], "val_fraction": 0.05}}))
    monkeypatch.setattr(route, "_run_stages", lambda *args: None)
    with pytest.raises(ConfigError, match=r"^ild\.data\.path: .* one split of the whole mix"):
        run_route(cfg)
    (ild / "meta.json").write_text(_json.dumps({"params": {"sources": ["x"], "split": "per_source"}}))
    run_route(cfg)
    cfg["kd"]["data"]["val_fraction"] = 0.5  # another fraction splits the shared sources otherwise
    with pytest.raises(ConfigError, match=r"^kd\.data\.val_fraction: 0\.5, but ild\.data\.val_fraction is"):
        run_route(cfg)
