"""Runtime settings (hybridlm/model/runtime.py) live apart from the saved model config.

1. An export written before they left ``config.json`` (tests/data/export_before_runtime_settings: that version's
   config.json, which says backend torch, loss_chunks 3, fuse_projections false) loads through
   ``from_pretrained`` and the Auto classes, runs with the defaults (or with ``runtime=...``), computes what the
   model it was saved from computes, and a re-save writes no runtime key.
2. A new export's config.json holds none; ``set_runtime`` reaches every module and refuses a bad value whole; the
   Triton kernel choices (``conv_kernel``, ``norm_kernel``, ``loss_kernel``) reach the ops that take them.
3. YAML: a runtime key in a model section is one line naming the ``runtime`` section; ``runtime.*`` is checked.
"""
import inspect
import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_config
from hybridlm.config.errors import ConfigError
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.runtime import RUNTIME_KEYS, RuntimeSettings

OLD_EXPORT = Path(__file__).parent / "data" / "export_before_runtime_settings"
KERNEL_KEYS = ("conv_kernel", "norm_kernel", "loss_kernel")


def _old_export(tmp_path):
    """The old config.json beside weights of the same shapes (the parameter names did not change)."""
    folder = tmp_path / "old"
    shutil.copytree(OLD_EXPORT, folder)
    values = json.loads((folder / "config.json").read_text())
    assert {"backend", "loss_chunks", "fuse_projections"} <= set(values)  # the fixture is the old format
    shapes = {k: v for k, v in values.items() if k not in RUNTIME_KEYS and k not in (
        "architectures", "dtype", "model_type", "transformers_version", "num_layers")}
    torch.manual_seed(0)
    source = HybridForCausalLM(HybridConfig(**shapes, runtime={"backend": "torch"})).eval()
    source.save_pretrained(tmp_path / "weights")
    shutil.copy(tmp_path / "weights" / "model.safetensors", folder / "model.safetensors")
    return folder, source


def test_an_old_export_loads_runs_with_the_defaults_and_resaves_without_runtime_keys(tmp_path):
    folder, source = _old_export(tmp_path)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        expected = source(input_ids=ids).logits
    for model in (HybridForCausalLM.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)):
        assert isinstance(model, HybridForCausalLM)
        assert model.runtime == RuntimeSettings()  # not the backend / chunks / fusion the old file names
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(input_ids=ids).logits, expected)
    chosen = HybridForCausalLM.from_pretrained(folder, runtime={"backend": "torch", "loss_chunks": 2})
    assert chosen.runtime.loss_chunks == 2 and chosen.model.layers[2].mixer.runtime is chosen.runtime
    chosen.save_pretrained(tmp_path / "resaved")
    old = json.loads((folder / "config.json").read_text())
    new = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert not set(new) & set(RUNTIME_KEYS) and "runtime" not in new and "_runtime" not in new
    for kind in ("gdn", "kda"):  # options the delta-rule mixers gained since, written at their defaults (off)
        for option in ("gate_bias", "beta_bias"):
            if option not in old.get(kind, {}):
                assert new[kind].pop(option) is False
    assert {k: v for k, v in old.items() if k not in RUNTIME_KEYS} == new  # nothing else changed


def test_set_runtime_reaches_every_module_and_refuses_a_bad_value_whole():
    model = HybridForCausalLM(tiny_config())
    holders = [m for m in model.modules() if "runtime" in vars(m)]
    assert len(holders) > len(model.model.layers)  # the mixers, the MLPs and the norms
    model.set_runtime(fuse_projections=False, loss_chunks=2)
    assert all(m.runtime is model.runtime for m in holders)
    assert model.runtime.fuse_projections is False and model.config.runtime.loss_chunks == 2
    with pytest.raises(ConfigError, match=r"^runtime.backend: expected one of"):
        model.set_runtime(loss_chunks=4, backend="cuda")
    assert model.runtime.loss_chunks == 2  # nothing changed
    assert all(m.runtime is model.runtime for m in holders)


def test_the_switches_change_how_it_runs_not_what_it_computes():
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config()).train()
    ids = torch.randint(0, 512, (2, 16))
    first = model(input_ids=ids, labels=ids).loss
    model.set_runtime(loss_chunks=3, fuse_projections=False, fuse_residual_norm=False)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, first)


def test_a_new_export_holds_no_runtime_key(tmp_path):
    HybridForCausalLM(tiny_config(loss_chunks=5, conv_kernel="fla", norm_kernel="fla", loss_kernel="fla")
                      ).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert set(KERNEL_KEYS) <= set(RUNTIME_KEYS)
    assert not set(saved) & (set(RUNTIME_KEYS) | {"runtime", "_runtime"})
    loaded = HybridForCausalLM.from_pretrained(tmp_path).runtime
    assert loaded.loss_chunks == 8 and all(getattr(loaded, key) == "project" for key in KERNEL_KEYS)


def test_the_kernel_choices_reach_the_ops(monkeypatch):
    """Each op with a project kernel and an fla one gets the model's choice as an argument: the norms and the
    gated output norms ``norm_kernel``, the short convs ``conv_kernel``, the LM-head loss ``loss_kernel``."""
    import hybridlm.model.layers.conv as conv
    import hybridlm.model.layers.delta_rule as delta_rule
    import hybridlm.model.layers.mamba2 as mamba2
    import hybridlm.model.layers.norm as norm
    import hybridlm.model.modeling as modeling
    seen = defaultdict(set)

    def spy(module, name, key):
        real = getattr(module, name)

        def call(*args, **kwargs):
            bound = inspect.signature(real).bind(*args, **kwargs)
            bound.apply_defaults()
            seen[name].add(bound.arguments[key])
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, call)

    ops = {"rms_norm": norm, "add_rms_norm": norm, "gated_rms_norm": delta_rule, "skip_gated_rms_norm": mamba2,
           "short_conv": conv, "linear_cross_entropy": modeling}
    for name, module in ops.items():
        spy(module, name, {"short_conv": "conv_kernel", "linear_cross_entropy": "loss_kernel"}.get(name, "norm_kernel"))
    model = HybridForCausalLM(tiny_config(conv_kernel="fla", norm_kernel="fla", loss_kernel="fla")).train()
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids)
    assert seen == {name: {"fla"} for name in ops}
    seen.clear()
    model.set_runtime(conv_kernel="project", norm_kernel="project", loss_kernel="project")
    model(input_ids=ids, labels=ids)
    assert seen == {name: {"project"} for name in ops}
    with pytest.raises(ConfigError, match=r"^runtime.norm_kernel: expected one of"):
        model.set_runtime(norm_kernel="cuda")


@pytest.mark.parametrize("values,message", [
    ({"hybrid_override_pattern": "*-", "backend": "torch"},
     "model.backend: how the model runs, not what it is; set runtime.backend instead"),
    ({"hybrid_override_pattern": "*-", "fuse_projections": False},
     "model.fuse_projections: how the model runs, not what it is; set runtime.fuse_projections instead"),
])
def test_a_runtime_key_in_a_model_section_names_the_runtime_section(values, message):
    with pytest.raises(ConfigError) as e:
        HybridConfig.from_user_dict(values)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_code_that_passes_a_runtime_key_to_the_config_is_told_where_it_goes():
    with pytest.raises(ConfigError, match=r"^backend: a runtime setting, not part of the model config; pass "
                                          r"runtime=\{'backend': \.\.\.\}"):
        HybridConfig(backend="torch")


def test_pretrain_checks_the_runtime_section(tmp_path):
    from pretrain.train import check_sections
    sections = {"model": {"hybrid_override_pattern": "*-", "hidden_size": 64, "intermediate_size": 64,
                          "mla": {"num_heads": 2}},
                "data": {"path": str(tmp_path / "data")},
                "optim": {"micro_batch_size": 1, "global_batch_size": 1, "lr": 1e-3, "max_steps": 1},
                "run": {"output_dir": str(tmp_path / "run")}, "runtime": {"loss_chunk": 2}}
    with pytest.raises(ConfigError, match=r"^runtime: unknown key 'loss_chunk'"):
        check_sections(sections)
    sections["runtime"] = {"loss_chunks": 2}
    check_sections(sections)
