"""SMART stage (per-layer KL sensitivities by in-place layer swaps) and composing the hybrid from two students."""
import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridForCausalLM
from conftest import assert_chart, demo_file, subprocess_env

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 32


def _env():
    return subprocess_env()


def _make_upcycled(root: Path, n_kv: int, qk_rope_head_dim: int) -> dict:
    """A tiny random Llama (real Llama-3.2 tokenizer) and its two students from `upcycle init`."""
    from hybridlm.data import load_tokenizer
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=n_kv, head_dim=16, vocab_size=len(tok), tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    teacher = root / "teacher"
    LlamaForCausalLM(cfg).save_pretrained(teacher)
    tok.save_pretrained(teacher)
    init = subprocess.run([sys.executable, "-m", "upcycle.cli", "init", "--teacher", str(teacher), "--out",
                           str(root / "init"), "--kv-lora-rank", "32", "--qk-rope-head-dim", str(qk_rope_head_dim),
                           "--calib-tokens", "0"],  # SMART's subject is the swap, not calibrated students
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-2000:]
    return dict(teacher=teacher, mla=root / "init" / "mla_student", mamba=root / "init" / "mamba2_student")


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """2 KV heads, rope 8: an inexact MLA student (as in real use)."""
    return _make_upcycled(tmp_path_factory.mktemp("gqa"), n_kv=2, qk_rope_head_dim=8)


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """1 KV head, every head dim rotating, full ranks: the MLA student reproduces the teacher."""
    return _make_upcycled(tmp_path_factory.mktemp("exact"), n_kv=1, qk_rope_head_dim=16)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, gqa):
    alpaca = demo_file("alpaca_en_demo.json")
    from hybridlm.data import DataConfig, ensure_prepared
    out = tmp_path_factory.mktemp("data") / "alpaca"
    ensure_prepared(DataConfig(path=str(out), seq_len=SEQ_LEN, sources=[str(alpaca)], tokenizer=str(gqa["teacher"])),
                    progress=False)
    return out


def _batches(data_dir, n=1, bs=2):
    from hybridlm.data import PackedTokens, validation_batches
    return validation_batches(PackedTokens(data_dir, "val"), SEQ_LEN, bs, n)


def _load(paths):
    from hybridlm.students import load_student
    from hybridlm.teacher import load_teacher
    return load_teacher(paths["teacher"]), load_student(paths["mla"], "mla"), load_student(paths["mamba"], "mamba")


def _parser():
    from smart_select.stage import add_subcommand as add_smart
    from upcycle.compose import add_subcommand as add_compose
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    add_smart(sub)
    add_compose(sub)
    return p


def _run_main(argv):
    """(rc, stderr lines) of the ``upcycle`` CLI, in process."""
    from upcycle.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue().strip().splitlines()


# ----------------------------------------------------------------------------------------------- tests
def test_swap_equals_explicit_composition_and_restores_the_student(gqa, data_dir):
    from upcycle.compose import compose_hybrid
    from smart_select.stage import layer_sensitivities, model_kl
    teacher, mla, mamba = _load(gqa)
    batches = _batches(data_dir)
    before = list(mamba.model.layers)
    state = {k: v.clone() for k, v in mamba.state_dict().items()}
    kl_all, kl = layer_sensitivities(teacher, mla, mamba, batches)
    assert [id(m) for m in mamba.model.layers] == [id(m) for m in before]  # swapped back
    assert all(torch.equal(v, mamba.state_dict()[k]) for k, v in state.items())
    assert len(kl) == 4 and kl_all > 0 and all(k > 0 for k in kl)
    assert abs(model_kl(teacher, mamba, batches) - kl_all) < 1e-5
    for i in range(4):
        composed = compose_hybrid(mla, mamba, [i])
        assert composed.config.layer_plan[2 * i] == "mla"
        assert abs(model_kl(teacher, composed, batches) - kl[i]) < 1e-5, i


def test_compose_extremes_equal_the_students_exactly(gqa):
    from upcycle.compose import compose_hybrid
    _, mla, mamba = _load(gqa)
    ids = torch.randint(0, mla.config.vocab_size, (2, 24))
    all_mla = compose_hybrid(mla, mamba, range(4))
    assert torch.equal(all_mla(input_ids=ids).logits, mla(input_ids=ids).logits)
    none = compose_hybrid(mla, mamba, [])
    assert torch.equal(none(input_ids=ids).logits, mamba(input_ids=ids).logits)
    mixed = compose_hybrid(mla, mamba, [0, 2])
    assert mixed.config.hybrid_override_pattern == "*-S-*-S-"
    assert mixed.config.mla == mla.config.mla and mixed.config.mamba2 == mamba.config.mamba2
    # after ILD the MLPs / norms of the two students differ: each layer's come from its mixer's student
    with torch.no_grad():
        for block in mla.model.layers:
            for prm in block.parameters():
                prm.add_(0.01)
    mixed = compose_hybrid(mla, mamba, [0, 2])
    src = {0: mla, 1: mamba, 2: mla, 3: mamba}
    sd = mixed.state_dict()
    for key, val in sd.items():
        if key.startswith("model.layers."):
            assert torch.equal(val, src[int(key.split(".")[2]) // 2].state_dict()[key]), key
        else:
            assert torch.equal(val, mamba.state_dict()[key]), key


def test_compose_round_trips_through_save_and_from_pretrained(gqa, tmp_path):
    from upcycle.compose import compose_from_dirs, compose_hybrid
    _, mla, mamba = _load(gqa)
    info = compose_from_dirs(gqa["mla"], gqa["mamba"], [3, 0], tmp_path / "hybrid")
    assert info["mla_layers"] == [0, 3] and info["pattern"] == "*-S-S-*-"
    loaded = HybridForCausalLM.from_pretrained(tmp_path / "hybrid")  # strict
    ids = torch.randint(0, mla.config.vocab_size, (1, 20))
    assert torch.equal(loaded(input_ids=ids).logits, compose_hybrid(mla, mamba, [0, 3])(input_ids=ids).logits)
    assert json.loads((tmp_path / "hybrid" / "compose.json").read_text())["layer_sources"] == \
        ["mla", "linear", "linear", "mla"]
    assert (tmp_path / "hybrid" / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match="already exists"):
        compose_from_dirs(gqa["mla"], gqa["mamba"], [0], tmp_path / "hybrid")
    for folder in (gqa["mla"], gqa["mamba"], tmp_path / "hybrid"):  # `upcycle init` and compose write no code
        assert not list(folder.glob("*.py")) and "auto_map" not in json.loads((folder / "config.json").read_text())
    args = _parser().parse_args(["compose", "--mla-student", str(gqa["mla"]), "--mamba-student", str(gqa["mamba"]),
                                 "--mla-layers", "0", "--out", str(tmp_path / "shared"), "--remote-code"])
    args.fn(args)  # the opt-in
    assert (tmp_path / "shared" / "hybrid_lm_auto.py").is_file()
    assert "auto_map" in json.loads((tmp_path / "shared" / "config.json").read_text())


def test_exact_mla_student_has_zero_kl_and_smart_composes_it(exact, data_dir, tmp_path):
    """One KV head + rope 16 + full ranks: the MLA student is the teacher, so KL ~ 0 for it; the all-Mamba2
    student is far off. SMART measures each layer's KL (checked against a hybrid composed here), picks 2 of 4
    layers by the selection rule, and the hybrid composed from its report is the one composed here."""
    from smart_select.selection import select_layers
    from upcycle.compose import compose_hybrid
    from smart_select.stage import model_kl
    teacher, mla, mamba = _load(exact)
    batches = _batches(data_dir)
    assert model_kl(teacher, mla, batches) < 1e-6
    kl_all = model_kl(teacher, mamba, batches)
    assert kl_all > 1e-3
    p = _parser()
    args = p.parse_args(["smart", "--teacher", str(exact["teacher"]), "--mla-student", str(exact["mla"]),
                         "--mamba-student", str(exact["mamba"]), "--data-path", str(data_dir),
                         "--seq-len", str(SEQ_LEN), "--batches", "1", "--batch-size", "2", "--n-mla", "2",
                         "--out", str(tmp_path / "smart")])
    result = args.fn(args)
    assert abs(result["kl_all"] - kl_all) < 1e-9
    # layer 1 alone as MLA, measured here, is the stage's kl[1]; sensitivity = kl_all - kl
    assert abs(result["kl"][1] - model_kl(teacher, compose_hybrid(mla, mamba, [1]), batches)) < 1e-9
    assert all(abs(result["kl_all"] - s - k) < 1e-12 for s, k in zip(result["sensitivity"], result["kl"]))
    assert result["chosen"] == select_layers(result["sensitivity"], 2) and len(result["chosen"]) == 2
    args = p.parse_args(["compose", "--mla-student", str(exact["mla"]), "--mamba-student", str(exact["mamba"]),
                         "--from-smart", str(tmp_path / "smart" / "smart_report.json"), "--out", str(tmp_path / "h")])
    args.fn(args)
    hybrid = HybridForCausalLM.from_pretrained(tmp_path / "h")
    kl_hybrid = model_kl(teacher, hybrid, batches)
    assert abs(kl_hybrid - model_kl(teacher, compose_hybrid(mla, mamba, result["chosen"]), batches)) < 1e-9
    assert kl_hybrid < kl_all  # two exact MLA layers bring the hybrid closer to the teacher


def test_kl_restore_picks_the_layer_a_planted_sensitivity_makes_best(exact, data_dir, tmp_path):
    """Layer 1's Mamba2 mixer writes noise: restoring layer 1 to attention lowers the KL most. kl_restore takes
    it with the next largest drop; SMART's spaced rule (0, then 2 or 3) cannot take layer 1 for 2 MLA layers."""
    from hybridlm.students import load_student
    from smart_select.selection import restore_layers
    planted = tmp_path / "planted_mamba2"
    student = load_student(exact["mamba"], "mamba")
    with torch.no_grad():
        w = student.model.layers[2].mixer.out_proj.weight  # sublayer 2: layer 1's mixer
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))  # noise for its init
    student.save_pretrained(planted)
    p = _parser()
    chosen = {}
    for method in ("kl_restore", "smart"):
        args = p.parse_args(["smart", "--teacher", str(exact["teacher"]), "--mla-student", str(exact["mla"]),
                             "--linear-student", str(planted), "--data-path", str(data_dir), "--seq-len",
                             str(SEQ_LEN), "--batches", "1", "--batch-size", "2", "--n-mla", "2", "--method", method,
                             "--out", str(tmp_path / method)])
        result = args.fn(args)
        chosen[method] = result["chosen"]
        rep = json.loads((tmp_path / method / "smart_report.json").read_text())
        assert rep["method"] == method and rep["chosen"] == result["chosen"]
        assert json.loads((tmp_path / method / "smart_run.json").read_text())["selection"] == method
    s = result["sensitivity"]
    assert max(range(4), key=lambda i: s[i]) == 1, s  # the plant made layer 1 the most sensitive
    assert 1 in chosen["kl_restore"] and chosen["kl_restore"] == restore_layers(s, 2)
    assert chosen["smart"][0] == 0 and 1 not in chosen["smart"]
    assert "KL-restore layer selection" in (tmp_path / "kl_restore" / "smart_report.md").read_text()


def test_restore_layers_takes_the_largest_drops_in_layer_order():
    from smart_select.selection import restore_layers
    assert restore_layers([0.1, 0.9, 0.8, 0.2, 0.8], 3) == [1, 2, 4]  # clustered is fine; a tie to the earlier
    assert restore_layers([0.5, 0.5, 0.5], 2) == [0, 1]
    assert restore_layers([0.3, 0.1], 0) == []
    with pytest.raises(ConfigError, match="n_mla: expected an integer between 0 and the 2 layers"):
        restore_layers([0.3, 0.1], 3)


def test_smart_cli_end_to_end_writes_the_report(gqa, tmp_path, capsys):
    p = _parser()
    args = p.parse_args(["smart", "--teacher", str(gqa["teacher"]), "--mla-student", str(gqa["mla"]),
                         "--mamba-student", str(gqa["mamba"]), "--data-path", str(tmp_path / "data"),
                         "--data-source", str(demo_file("alpaca_en_demo.json")), "--seq-len", str(SEQ_LEN), "--batches", "1",
                         "--batch-size", "2", "--n-mla", "2", "--out", str(tmp_path / "smart")])
    result = args.fn(args)
    out = capsys.readouterr().out
    chosen = result["chosen"]
    assert len(chosen) == 2 and chosen[0] == 0 and chosen[1] in (2, 3)
    s = result["sensitivity"]
    assert chosen[1] == (3 if s[3] > s[2] else 2)
    rep = json.loads((tmp_path / "smart" / "smart_report.json").read_text())
    assert rep["chosen"] == chosen and rep["num_layers"] == 4 and abs(rep["kl_all"] - result["kl_all"]) < 1e-12
    assert rep["kv"]["kv_lora_rank"] == 32 and rep["kv"]["qk_rope_head_dim"] == 8
    # KV: 2 MLA layers * (32 + 8) values vs 4 layers * 2 * 2 kv heads * 16
    assert abs(rep["kv"]["ratio"] - 2 * 40 / (4 * 2 * 2 * 16)) < 1e-12
    assert "| layer |" in (tmp_path / "smart" / "smart_report.md").read_text()
    assert_chart(tmp_path / "smart" / "smart_report.png")
    assert "| layer |" in out and f"chosen MLA layers: {','.join(map(str, chosen))}" in out
    run = json.loads((tmp_path / "smart" / "smart_run.json").read_text())
    assert run["data"]["tokens"] == 1 * 2 * SEQ_LEN and run["kl_unit"] == "nats/token"

    # an explicit list is measured and reported as given
    args = p.parse_args(["smart", "--teacher", str(gqa["teacher"]), "--mla-student", str(gqa["mla"]),
                         "--mamba-student", str(gqa["mamba"]), "--data-path", str(tmp_path / "data"),
                         "--seq-len", str(SEQ_LEN), "--batches", "1", "--batch-size", "2", "--mla-layers", "1,3",
                         "--out", str(tmp_path / "explicit")])
    assert args.fn(args)["chosen"] == [1, 3]

    args = p.parse_args(["compose", "--mla-student", str(gqa["mla"]), "--mamba-student", str(gqa["mamba"]),
                         "--from-smart", str(tmp_path / "smart"), "--out", str(tmp_path / "hybrid")])
    info = args.fn(args)
    assert info["mla_layers"] == chosen
    assert HybridForCausalLM.from_pretrained(tmp_path / "hybrid").config.layer_plan[2 * chosen[1]] == "mla"


def test_errors_are_one_line(gqa, exact, tmp_path):
    from upcycle.compose import compose_hybrid
    _, mla, mamba = _load(gqa)
    _, mla_x, _ = _load(exact)
    cases = [
        (lambda: compose_hybrid(mla, mamba, [4]), "out of range"),
        (lambda: compose_hybrid(mla, mamba, [1, 1]), "more than once"),
        (lambda: compose_hybrid(mamba, mla, [0]), "mla student"),
        (lambda: compose_hybrid(mla_x, mamba, [0]), "differs"),  # students of another teacher
    ]
    for fn, needle in cases:
        with pytest.raises(ConfigError) as e:
            fn()
        assert needle in str(e.value) and "\n" not in str(e.value)

    base = ["--mla-student", str(gqa["mla"]), "--mamba-student", str(gqa["mamba"])]
    for argv, needle in [
        (["compose", *base, "--mla-layers", "0,9", "--out", str(tmp_path / "a")],
         "error: mla_layers: index 9 out of range"),
        (["compose", *base, "--mla-layers", "0,x", "--out", str(tmp_path / "a")], "error: --mla-layers:"),
        (["compose", "--mla-student", str(tmp_path / "nope"), "--mamba-student", str(gqa["mamba"]), "--mla-layers", "0",
          "--out", str(tmp_path / "a")], "error: --mla-student:"),
        (["compose", *base, "--from-smart", str(tmp_path / "none.json"), "--out", str(tmp_path / "a")],
         "error: --from-smart:"),
        (["smart", "--teacher", str(gqa["teacher"]), *base, "--data-path", str(tmp_path / "d"), "--n-mla", "7",
          "--out", str(tmp_path / "s")], "error: --n-mla:"),
        (["smart", "--teacher", str(gqa["teacher"]), *base, "--data-path", str(tmp_path / "d"), "--n-mla", "2",
          "--out", str(tmp_path / "s")], "error: data.path:"),
    ]:
        rc, lines = _run_main(argv)
        errors = [l for l in lines if l.startswith("error:")]  # (transformers may draw loading bars above it)
        assert rc == 2 and errors == [lines[-1]] and lines[-1].startswith(needle), (argv, lines)
    assert not (tmp_path / "a").exists()


@pytest.mark.slow  # ~35 s: a launch of two ranks
def test_smart_on_two_ranks_measures_what_one_rank_does(gqa, data_dir, tmp_path):
    """`upcycle smart` under a launcher: each rank measures its share of the batches (0 and 2 on rank 0, 1 on rank
    1), the KL sums are added over the ranks, rank 0 alone writes the report; the same sensitivities as one rank."""
    import socket
    common = ["smart", "--teacher", str(gqa["teacher"]), "--mla-student", str(gqa["mla"]), "--mamba-student",
              str(gqa["mamba"]), "--data-path", str(data_dir), "--seq-len", str(SEQ_LEN), "--batches", "3",
              "--batch-size", "2", "--n-mla", "2", "--device", "cpu"]
    p = _parser()
    args = p.parse_args([*common, "--out", str(tmp_path / "one")])
    one = args.fn(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
                          "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "upcycle.cli", *common,
                          "--out", str(tmp_path / "two")], cwd=REPO, env=subprocess_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "smart_report.json").read_text())
    assert two["chosen"] == one["chosen"]
    assert two["kl_all"] == pytest.approx(one["kl_all"], rel=1e-9)
    assert [r["kl"] for r in two["layers"]] == pytest.approx(one["kl"], rel=1e-9)
    run = json.loads((tmp_path / "two" / "smart_run.json").read_text())
    assert run["data"]["tokens"] == 3 * 2 * SEQ_LEN
    assert res.stdout.count("chosen MLA layers") == 1  # rank 0 alone reports
