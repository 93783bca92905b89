"""Model assembly: patterns, configs, parameter counts, the chunked loss, HF save / load."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from conftest import REPO, rel_err, subprocess_env, tiny_config
from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.loss import linear_cross_entropy
from hybridlm.model.pattern import attention_positions, parse_pattern, pattern_from_ratio
from hybridlm.model.summary import model_summary


def test_pattern_plan_and_ratio():
    assert parse_pattern("*-M-", 4, "gdn") == ["mla", "mlp", "gdn", "mlp"]
    assert parse_pattern("*-G-K-S-", None, "gdn") == ["mla", "mlp", "gdn", "mlp", "kda", "mlp", "mamba2", "mlp"]
    assert attention_positions(12, 0.25) == [0, 4, 8]
    assert pattern_from_ratio(24, 0.25) == "*-M-M-M-*-M-M-M-*-M-M-M-"
    assert pattern_from_ratio(24, 0.0) == "M-" * 12
    cfg = HybridConfig(num_layers=24, hybrid_attention_ratio=0.25, mixer="kda", vocab_size=64, hidden_size=64,
                       intermediate_size=64, kda=dict(num_heads=2))
    assert cfg.hybrid_override_pattern == "*-M-M-M-*-M-M-M-*-M-M-M-" and cfg.layer_plan[2] == "kda"


@pytest.mark.parametrize("values,field", [
    (dict(hybrid_override_pattern="*-X-"), "hybrid_override_pattern: unknown symbol 'X'"),
    (dict(hybrid_override_pattern="*-M-", num_layers=6), "hybrid_override_pattern: length 4 does not match num_layers 6"),
    (dict(hybrid_override_pattern="*-M-M-M-", hybrid_attention_ratio=0.5), "hybrid_attention_ratio: 0.5 disagrees"),
    (dict(gdn=dict(num_heads=5, head_dim=None)), "gdn.num_heads: num_heads 5 does not divide hidden_size 64"),
    (dict(mla=dict(num_heads=3, v_head_dim=None)), "mla: num_heads 3 does not divide hidden_size 64"),
    (dict(gdn=dict(num_heads=2, head_dim=16, num_v_heads=3)), "gdn.num_v_heads: 3 is not a multiple of num_heads 2"),
    (dict(mamba2=dict(head_dim=24)), "mamba2.head_dim: head_dim 24 does not divide d_inner 128"),
    (dict(mixer="rwkv"), "mixer: unknown mixer 'rwkv'"),
    (dict(gdn=dict(num_heads=2, heads=4)), "gdn: unknown key 'heads'"),
    (dict(backend="cuda"), "runtime.backend: expected one of 'auto', 'torch', 'triton', got 'cuda'"),
    (dict(hybrid_override_pattern="----"), "hybrid_override_pattern: has no sequence mixer"),
    # sizes of 0 or below: named, not a ZeroDivisionError, a negative-dimension error or a silent default
    (dict(gdn=dict(num_heads=0)), "gdn.num_heads: must be a positive integer, got 0"),
    (dict(gdn=dict(num_heads=2, head_dim=16, head_v_dim=0)), "gdn.head_v_dim: must be a positive integer, got 0"),
    (dict(kda=dict(num_heads=2, head_dim=0)), "kda.head_dim: must be a positive integer, got 0"),
    (dict(kda=dict(num_heads=2, head_dim=16, num_v_heads=0)), "kda.num_v_heads: must be a positive integer"),
    (dict(mamba2=dict(expand=0)), "mamba2.expand: must be a positive integer, got 0"),
    (dict(mamba2=dict(d_state=0)), "mamba2.d_state: must be a positive integer, got 0"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps: must be a positive number, got -1.0"),
    (dict(split_conv_outputs="yes"), "runtime.split_conv_outputs: expected true or false, got 'yes'"),
    (dict(projection_grads_in_place=1), "runtime.projection_grads_in_place: expected true or false, got 1"),
    (dict(loss_chunks=0), "runtime.loss_chunks: expected an integer >= 1, got 0"),
])
def test_bad_config_is_one_clear_line(values, field):
    with pytest.raises(ConfigError) as e:
        tiny_config(**values)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_default_config_builds_but_a_model_file_must_name_its_pattern():
    # transformers instantiates HybridConfig() when it diffs a config for saving (seen with 5.17)
    assert HybridConfig().hybrid_override_pattern == "*-M-M-M-"
    with pytest.raises(ConfigError, match=r"^model.hybrid_override_pattern: missing"):
        HybridConfig.from_user_dict({"hidden_size": 64, "num_layers": 4})


def test_unknown_top_level_model_key():
    with pytest.raises(ConfigError, match="model: unknown key 'hiden_size'"):
        HybridConfig.from_user_dict({"hiden_size": 3, "hybrid_override_pattern": "M-"})


@pytest.mark.parametrize("name,expected", [("gdn_300m", 307.8e6), ("kda_300m", 303.5e6), ("gdn_1b", 1203e6)])
def test_parameter_counts_match_spec(name, expected):
    cfg = HybridConfig.from_user_dict(yaml.safe_load((REPO / "configs" / "models" / f"{name}.yaml").read_text()))
    n = model_summary(cfg)["params"]
    assert abs(n - expected) / expected < 0.01, n


def test_every_shipped_model_config_builds():
    for path in sorted((REPO / "configs" / "models").glob("*.yaml")):
        values = yaml.safe_load(path.read_text())
        if values.get("vocab_size") == "auto":  # resolved from the data's tokenizer at run time
            values["vocab_size"] = 128256
        cfg = HybridConfig.from_user_dict(values)
        s = model_summary(cfg)
        assert s["layer_plan"] and s["params"] > s["non_embedding_params"] > 0, path.name


def test_dry_run_cli_prints_one_json_line():
    out = subprocess.run([sys.executable, "pretrain.py", "--config", "configs/models/gdn_300m_hybrid.yaml", "--dry-run"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stdout.splitlines() if l.strip()]
    info = json.loads(lines[-1])
    assert info["layer_plan"][:4] == ["mla", "mlp", "gdn", "mlp"] and info["layer_plan"].count("mla") == 3
    assert info["params"] > info["non_embedding_params"]


def test_dry_run_cli_bad_pattern_is_exit_2_with_field():
    out = subprocess.run([sys.executable, "pretrain.py", "--config", "configs/models/gdn_300m.yaml", "--dry-run",
                          "model.hybrid_override_pattern=M-Q-"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: hybrid_override_pattern")


def test_chunked_cross_entropy_equals_full_logits(seeded):
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    y[::5] = -100
    loss = linear_cross_entropy(h, w, y, num_chunks=4)
    ref = torch.nn.functional.cross_entropy(h @ w.t(), y, ignore_index=-100)
    assert rel_err(loss, ref) < 1e-6
    g = torch.autograd.grad(loss * 3, [h, w])
    r = torch.autograd.grad(ref * 3, [h, w])
    assert rel_err(g[0], r[0]) < 1e-5 and rel_err(g[1], r[1]) < 1e-5
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        assert rel_err(linear_cross_entropy(h, w, y, num_chunks=4), ref) < 1e-6


def test_model_loss_matches_logits_and_labels_convention(seeded):
    cfg = tiny_config()
    model = HybridForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    logits = model(ids).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    assert rel_err(model(ids, labels=ids).loss, ref) < 1e-5
    assert rel_err(model(ids[:, :-1], shift_labels=ids[:, 1:]).loss,
                   torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))) < 1e-5
    assert model(ids, labels=ids).logits is None  # the loss path never builds full logits


def test_model_is_causal(seeded):
    model = HybridForCausalLM(tiny_config())
    ids = torch.randint(0, 512, (1, 30))
    a = model(ids).logits
    ids2 = ids.clone()
    ids2[0, 20:] = (ids2[0, 20:] + 7) % 512
    b = model(ids2).logits
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-5) and not torch.allclose(a[:, 20:], b[:, 20:])


def test_save_and_strict_load_round_trip(tmp_path, seeded):
    from transformers import AutoModelForCausalLM
    import safetensors.torch as st
    model = HybridForCausalLM(tiny_config(tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 12))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, HybridForCausalLM)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.config.layer_plan == model.config.layer_plan
    state = st.load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.2.mixer.A_log")
    st.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing_keys: model.layers.2.mixer.A_log"):
        HybridForCausalLM.from_pretrained(tmp_path)


def test_tied_embeddings_share_storage():
    model = HybridForCausalLM(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_cli_override_reads_exponent_floats_without_a_dot():
    from hybridlm.config.loader import parse_override
    assert parse_override("optim.lr=3e-4") == {"optim": {"lr": 3e-4}}
    assert parse_override("run.output_dir=runs/a.b") == {"run": {"output_dir": "runs/a.b"}}


def _code_in(folder):
    return sorted(p.name for p in folder.rglob("*.py")), "auto_map" in json.loads((folder / "config.json").read_text())


def test_default_export_has_no_code_and_loads_after_importing_the_toolkit(tmp_path, seeded):
    """A saved model holds no .py and no auto_map; a fresh interpreter loads it through the Auto classes after
    `import hybridlm.model`, without trust_remote_code. A folder of an older version (auto_map + a .py, here
    tampered with) loads the same way, with or without trust_remote_code, and its .py never runs; re-saved, it
    carries no code any more."""
    model = HybridForCausalLM(tiny_config()).eval()
    model.save_pretrained(tmp_path / "m")
    assert _code_in(tmp_path / "m") == ([], False)
    HybridConfig.from_pretrained(tmp_path / "m").save_pretrained(tmp_path / "c")
    assert _code_in(tmp_path / "c") == ([], False)
    old = tmp_path / "old"
    model.save_pretrained(old)
    config = json.loads((old / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "hybrid_lm_auto.HybridConfig",
                          "AutoModelForCausalLM": "hybrid_lm_auto.HybridForCausalLM"}
    (old / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "code_ran"
    (old / "hybrid_lm_auto.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                           "from hybridlm.model import HybridConfig, HybridForCausalLM\n")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "ref.pt")
    script = (
        "import json, pathlib, torch\n"
        "import hybridlm.model\n"
        "from transformers import AutoModelForCausalLM, AutoConfig\n"
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        f"new, old = {str(tmp_path / 'm')!r}, {str(old)!r}\n"
        "for d, kw in ((new, {}), (old, {}), (old, {'trust_remote_code': True})):\n"
        "    assert type(AutoConfig.from_pretrained(d, **kw)) is hybridlm.model.HybridConfig\n"
        "    model = AutoModelForCausalLM.from_pretrained(d, **kw).eval()\n"
        "    assert type(model) is hybridlm.model.HybridForCausalLM\n"
        "    assert torch.equal(model(ref['ids']).logits, ref['logits'])\n"
        f"model.save_pretrained({str(tmp_path / 'resaved')!r})\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**subprocess_env(), "HF_MODULES_CACHE": str(tmp_path / "hf_modules")})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "hf_modules").exists()
    assert _code_in(tmp_path / "resaved") == ([], False)


def test_saved_model_loads_through_trust_remote_code_without_importing_the_toolkit(tmp_path, seeded):
    """The opt-in export (remote_code=True) carries hybrid_lm_auto.py and an auto_map, and loads with
    trust_remote_code=True in an interpreter that never imported the toolkit. A model re-saved there (by
    default) carries no code: the toolkit's classes are not copied into it."""
    model = HybridForCausalLM(tiny_config()).eval()
    model.save_pretrained(tmp_path / "m", remote_code=True)
    assert _code_in(tmp_path / "m") == (["hybrid_lm_auto.py"], True)
    model.config.save_pretrained(tmp_path / "c", remote_code=True)
    assert _code_in(tmp_path / "c") == (["hybrid_lm_auto.py"], True)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "ref.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r}, trust_remote_code=True).eval()\n"
        "assert 'hybridlm.model' in sys.modules  # brought in by the saved hybrid_lm_auto.py, not by this script\n"
        "assert torch.equal(model(ref['ids']).logits, ref['logits'])\n"
        f"model.save_pretrained({str(tmp_path / 'resaved')!r})\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**subprocess_env(), "HF_MODULES_CACHE": str(tmp_path / "hf_modules")})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    assert _code_in(tmp_path / "resaved") == ([], False)


@pytest.mark.parametrize("source", ["project", "fla"])
def test_chunked_cross_entropy_triton_path_through_the_interpreter(source):
    """The GPU path (the project's cross-entropy kernel per chunk, or fla's) run on CPU by the Triton interpreter,
    which has to be on before Triton is imported: a subprocess. Uneven chunks, ignored labels, an upstream
    gradient."""
    script = textwrap.dedent(f"""
        import torch
        from hybridlm.model.loss import linear_cross_entropy
        torch.manual_seed(0)
        h = torch.randn(37, 16, requires_grad=True)
        w = torch.randn(50, 16, requires_grad=True)
        y = torch.randint(0, 50, (37,))
        y[::5] = -100
        loss = linear_cross_entropy(h, w, y, num_chunks=4, triton=True, loss_kernel={source!r})
        ref = torch.nn.functional.cross_entropy(h @ w.t(), y, ignore_index=-100)
        g = torch.autograd.grad(loss * 3, [h, w])
        r = torch.autograd.grad(ref * 3, [h, w])
        with torch.no_grad():
            eval_loss = linear_cross_entropy(h, w, y, num_chunks=4, triton=True, loss_kernel={source!r})
        errs = [((loss - ref).abs() / ref.abs()).item(), ((eval_loss - ref).abs() / ref.abs()).item()]
        errs += [((a - b).norm() / b.norm()).item() for a, b in zip(g, r)]
        print(max(errs))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=subprocess_env(TRITON_INTERPRET="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5


def test_dry_run_checks_the_other_sections_too(capsys):
    """An experiment file's optim / run / data sections are checked by --dry-run, not only at the real run
    (pretrain.py's main in this process: a dry run builds nothing; the CLI itself is the tests above)."""
    from pretrain.cli import main
    for override, message in (("optim.lrr=1", "error: optim: unknown key 'lrr'"),
                              ("run.output_dir=", "error: run.output_dir: expected a directory path"),
                              ("data.seq_len=0", "error: data.seq_len: expected an integer >= 1")):
        rc = main(["--config", str(REPO / "configs/experiments/default_cpu.yaml"), "--dry-run", override])
        err = capsys.readouterr().err
        assert rc == 2 and err.strip().splitlines()[-1].startswith(message), err[-500:]
