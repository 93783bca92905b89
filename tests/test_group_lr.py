"""Per-group learning rates (``optim.group_lr``) on the real engine: a student's inherited / mixer / latent groups
(distill/param_groups.py), each at its own peak lr under the shared schedule, a group at 0 frozen byte for byte,
the settings refused with one line each, and a resume with other frozen groups refused."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from distill.param_groups import GROUPS, student_param_groups
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass
from hybridlm.engine import CheckpointError, Engine, OptimConfig, init_distributed
from hybridlm.model import HybridForCausalLM


@pytest.fixture(scope="module", autouse=True)
def _one_process_world():
    init_distributed()
    yield


def student(seed=0):
    torch.manual_seed(seed)
    return HybridForCausalLM(tiny_config(pattern="*-M-M-", mixer="mamba2"))


def optim(**kw):
    values = dict(micro_batch_size=2, global_batch_size=2, lr=1e-2, max_steps=4, warmup_steps=0, weight_decay=0.0,
                  precision="fp32", grad_clip=0.0)
    values.update(kw)
    return build_dataclass(OptimConfig, values, "optim")


def lm_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss, {}


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 512, (2, 16), generator=g)}


def named(model):
    return student_param_groups(model, model.parameters())


def test_groups_follow_the_layer_kinds():
    model = student()
    groups = named(model)
    assert list(groups) == list(GROUPS)
    ids = {g: {id(p) for p in ps} for g, ps in groups.items()}
    blocks = model.model.layers
    assert [b.kind for b in blocks] == ["mla", "mlp", "mamba2", "mlp", "mamba2", "mlp"]
    assert {id(p) for p in blocks[0].mixer.parameters()} == ids["latent"]
    assert {id(p) for b in (blocks[2], blocks[4]) for p in b.mixer.parameters()} == ids["mixer"]
    inherited = ids["inherited"]
    for b in blocks:
        assert {id(p) for p in b.norm.parameters()} <= inherited  # pre-norms came from the teacher
    assert {id(p) for p in blocks[1].mixer.parameters()} <= inherited  # MLPs too
    assert id(model.model.embed_tokens.weight) in inherited
    assert sum(len(v) for v in ids.values()) == len(list(model.parameters()))  # a partition


def test_each_group_steps_at_its_own_lr_and_a_group_at_zero_keeps_its_bytes():
    model = student()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = optim(lr=1e-2, group_lr={"inherited": 0.0, "latent": 1e-3})
    engine = Engine(model, cfg, lm_loss, named_groups=named(model))
    assert engine.lr == pytest.approx(1e-2)  # the reported lr is optim.lr's schedule
    engine.train_step([batch()])
    moved = {}
    for n, p in engine.module.named_parameters():
        moved[n] = (p.detach() - before[n]).abs()
    groups = {g: {id(p) for p in ps} for g, ps in named(engine.module).items()}
    params = dict(engine.module.named_parameters())
    for n, p in params.items():
        if id(p) in groups["inherited"]:
            assert torch.equal(p.detach(), before[n]), n  # frozen: the same bytes
            assert not p.requires_grad
    # AdamW's first update moves every element with a gradient by about lr: 1e-2 for the mixers, 1e-3 for MLA
    def typical(group):
        steps = torch.cat([moved[n].flatten() for n, p in params.items() if id(p) in groups[group]])
        return steps[steps > 0].median().item()
    assert typical("mixer") == pytest.approx(1e-2, rel=0.05)
    assert typical("latent") == pytest.approx(1e-3, rel=0.05)


def test_the_schedule_scales_every_group_alike():
    model = student()
    cfg = optim(lr=1e-2, min_lr=1e-3, warmup_steps=2, max_steps=6, group_lr={"mixer": 4e-2})
    engine = Engine(model, cfg, lm_loss, named_groups=named(model))
    seen = []
    for _ in range(4):
        rates = {g["group"]: g["lr"] for g in engine.ds_engine.basic_optimizer.param_groups}
        seen.append((engine.lr, rates))
        engine.train_step([batch()])
    for lr, rates in seen:
        assert rates["mixer"] == pytest.approx(4 * lr) and rates["inherited"] == pytest.approx(lr)
    assert [lr for lr, _ in seen][:2] == pytest.approx([5e-3, 1e-2])  # warmup


def test_group_settings_are_refused_with_one_line():
    model = student()
    with pytest.raises(ConfigError, match=r"optim.group_lr.mixr: not a parameter group of this run; expected one "
                                          r"of inherited, mixer, latent"):
        Engine(model, optim(group_lr={"mixr": 1e-3}), lm_loss, named_groups=named(model))
    with pytest.raises(ConfigError, match=r"optim.group_lr.mixer: expected a learning rate >= 0"):
        Engine(model, optim(group_lr={"mixer": -1.0}), lm_loss, named_groups=named(model))
    with pytest.raises(ConfigError, match=r"optim.group_lr.mixer: expected a number"):
        optim(group_lr={"mixer": "fast"})
    assert optim(group_lr={"mixer": "1e-4"}).group_lr == {"mixer": 1e-4}  # YAML 1.1 reads 1e-4 as a string
    with pytest.raises(ConfigError, match=r"optim.group_lr: every parameter group is frozen"):
        Engine(model, optim(group_lr={g: 0 for g in GROUPS}), lm_loss, named_groups=named(model))
    with pytest.raises(ConfigError, match=r"optim.group_lr: this run names no parameter groups"):
        Engine(student(), optim(group_lr={"mixer": 1e-3}), lm_loss)


def test_a_resume_with_other_frozen_groups_is_refused_and_a_changed_rate_is_noted(tmp_path):
    model = student()
    engine = Engine(model, optim(group_lr={"inherited": 0.0}), lm_loss, named_groups=named(model))
    engine.train_step([batch()])
    engine.save_checkpoint(tmp_path / "ckpt", 1)
    model = student()
    thawed = Engine(model, optim(), lm_loss, named_groups=named(model))
    with pytest.raises(CheckpointError, match=r"saved with the trained parameter groups .*this run trains .*"
                                              r"resume with the optim.group_lr it was saved with"):
        thawed.load_checkpoint(tmp_path / "ckpt")
    model = student()
    slower = Engine(model, optim(group_lr={"inherited": 0.0, "mixer": 1e-3}), lm_loss, named_groups=named(model))
    assert slower.load_checkpoint(tmp_path / "ckpt") is not None
    assert "optim.group_lr {'inherited': 0.0} -> {'inherited': 0.0, 'mixer': 0.001}" in slower.resume_note
    rates = {g["group"]: g["lr"] for g in slower.ds_engine.basic_optimizer.param_groups}
    assert rates["mixer"] == pytest.approx(1e-3 * slower.lr / 1e-2) and rates["latent"] == pytest.approx(slower.lr)
