"""Tests for hybridlm.engine: a real tiny LM trained through real DeepSpeed (CPU, gloo)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass
from conftest import subprocess_env
from hybridlm.engine import (
    CheckpointError,
    Engine,
    NonFiniteLossError,
    OptimConfig,
    all_reduce_flag,
    all_reduce_sum,
    free_port,
    get_rng_state,
    init_distributed,
    is_main,
    lr_at,
    lr_lambda,
)
from hybridlm.engine.schedule import decay_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_PATH = os.path.join(REPO, "tests", "engine_worker.py")

# The worker module holds the tiny model, loss and data; load it by path (tests/ is not a package).
_spec = importlib.util.spec_from_file_location("engine_worker", WORKER_PATH)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


@pytest.fixture(scope="module", autouse=True)
def _one_process_world():
    info = init_distributed()
    assert info.world_size == 1 and info.backend == "gloo"
    assert init_distributed() is info  # idempotent
    yield


# -------------------------------------------------------------------------------- utilities


def snapshot(engine: Engine):
    """Everything a skipped step must leave untouched, cloned."""
    ds = engine.ds_engine
    opt = ds.basic_optimizer
    state = {
        i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
        for i, g in enumerate(opt.param_groups)
        for p in g["params"]
    }
    zopt = engine.optimizer
    masters = getattr(zopt, "single_partition_of_fp32_groups", None) or zopt.fp32_groups_flat_partition
    return {
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "masters": [m.detach().clone() for m in masters],
        "opt_state": state,
        "lr": [g["lr"] for g in opt.param_groups],
        "sched": dict(engine.lr_scheduler.state_dict()),
    }


def assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    for x, y in zip(a["masters"], b["masters"]):
        assert torch.equal(x, y)
    assert a["opt_state"].keys() == b["opt_state"].keys()
    for i in a["opt_state"]:
        sa, sb = a["opt_state"][i], b["opt_state"][i]
        assert sa.keys() == sb.keys()
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert torch.equal(sa[k], sb[k]), (i, k)
            else:
                assert sa[k] == sb[k], (i, k)
    assert a["lr"] == b["lr"]
    assert a["sched"] == b["sched"]


def micro(batch, engine, poison_rows=()):
    return W.local_micro_batches(batch, 0, 1, engine.config.micro_batch_size, poison_rows)


def rng_equal(a, b) -> bool:
    na, nb = a["numpy"], b["numpy"]
    return (
        a["python"] == b["python"]
        and {k: v for k, v in na.items() if k != "keys"} == {k: v for k, v in nb.items() if k != "keys"}
        and torch.equal(na["keys"], nb["keys"])
        and torch.equal(a["torch_cpu"], b["torch_cpu"])
    )


# --------------------------------------------------------------------------- (f) config errors


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError) as e:
        build_dataclass(OptimConfig, {"micro_batch_size": 4, "global_batch_size": 6, "lr": 1e-3, "max_steps": 10}, "optim")
    msg = str(e.value)
    assert "\n" not in msg and "optim.global_batch_size" in msg and "micro_batch_size=4" in msg

    cfg = build_dataclass(OptimConfig, {"micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3, "max_steps": 10}, "optim")
    assert cfg.gradient_accumulation_steps(1) == 4 and cfg.gradient_accumulation_steps(4) == 1
    with pytest.raises(ConfigError) as e:
        cfg.gradient_accumulation_steps(3)
    msg = str(e.value)
    assert "\n" not in msg
    assert "global_batch_size" in msg and "micro_batch_size" in msg and "world size (3)" in msg

    for bad in ({"precision": "fp16"}, {"zero_stage": 3}, {"lr": 0.0}, {"min_lr": 1.0}, {"warmup_steps": 11},
                {"betas": [0.9, 1.5]}, {"grad_clip": -1.0}, {"max_consecutive_nonfinite": 0}):
        values = {"micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3, "max_steps": 10, **bad}
        field = next(iter(bad))
        with pytest.raises(ConfigError, match=rf"optim\.{field}"):
            build_dataclass(OptimConfig, values, "optim")


# ------------------------------------------------------------------------------- (a) schedule


def test_schedule_formula():
    kw = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert lr_at(0, **kw) == pytest.approx(1e-3 / 10)
    assert lr_at(4, **kw) == pytest.approx(1e-3 * 5 / 10)
    assert lr_at(9, **kw) == pytest.approx(1e-3)
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(60, **kw) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # cosine midpoint
    assert lr_at(35, **kw) == pytest.approx(1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(110, **kw) == pytest.approx(1e-4)
    assert lr_at(500, **kw) == pytest.approx(1e-4)
    f = lr_lambda(**kw)
    assert f(60) == pytest.approx(lr_at(60, **kw) / 1e-3)
    # no warmup: starts at the peak
    assert lr_at(0, lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=4) == pytest.approx(1.0)


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor():
    """Warmup 10, then 100 steps: the peak until the last 20 % (20 steps), a straight line down to min_lr at
    the last update (step 109), the floor after it."""
    kw = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="wsd", decay_fraction=0.2)
    assert lr_at(0, **kw) == pytest.approx(1e-4) and lr_at(9, **kw) == pytest.approx(1e-3)
    assert all(lr_at(s, **kw) == pytest.approx(1e-3) for s in range(10, 90))
    decay = [lr_at(s, **kw) for s in range(89, 110)]
    steps = [b - a for a, b in zip(decay, decay[1:])]
    assert steps == pytest.approx([-(1e-3 - 1e-4) / 20] * 20)  # linear, 20 equal steps
    assert lr_at(109, **kw) == pytest.approx(1e-4) and lr_at(500, **kw) == pytest.approx(1e-4)
    # the fraction is of the post-warmup steps, rounded up, at least one step
    assert decay_steps(warmup_steps=10, max_steps=110, decay_fraction=0.2) == 20
    assert decay_steps(warmup_steps=0, max_steps=7, decay_fraction=0.1) == 1
    # a whole-run decay (fraction 1) is a linear schedule
    lin = dict(kw, decay_fraction=1.0)
    assert lr_at(60, **lin) == pytest.approx(1e-3 - (1e-3 - 1e-4) * 51 / 100)
    # wsd spends more of the run at a high rate than cosine at the same floor
    cos = dict(kw, schedule="cosine")
    assert sum(lr_at(s, **kw) for s in range(110)) > 1.3 * sum(lr_at(s, **cos) for s in range(110))


def test_constant_schedule_keeps_the_peak_after_warmup():
    kw = dict(lr=3e-4, min_lr=1e-5, warmup_steps=4, max_steps=50, schedule="constant")
    assert [lr_at(s, **kw) for s in range(4)] == pytest.approx([3e-4 * k / 4 for k in range(1, 5)])
    assert all(lr_at(s, **kw) == pytest.approx(3e-4) for s in range(4, 80))
    with pytest.raises(ValueError, match="schedule"):
        lr_at(0, **dict(kw, schedule="linear"))


@pytest.mark.parametrize("bad", [{"schedule": "linear"}, {"decay_fraction": 0.0}, {"decay_fraction": 1.5}])
def test_schedule_settings_are_checked(bad):
    values = {"micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3, "max_steps": 10, **bad}
    with pytest.raises(ConfigError, match=rf"optim\.{next(iter(bad))}"):
        build_dataclass(OptimConfig, values, "optim")


# --------------------------------------------------------------------------- (a) training


def test_training_reduces_loss_and_follows_schedule():
    cfg = W.make_config("fp32", lr=2e-2, min_lr=2e-3, warmup_steps=3, max_steps=25)
    eng = Engine(W.build_model(), cfg, W.loss_fn)
    assert eng.gradient_accumulation_steps == 2
    # weight-decay groups: >=2-D params decayed except the tagged positional table
    groups = eng.ds_engine.basic_optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [cfg.weight_decay, 0.0]
    batches = W.global_batches(25, cfg.global_batch_size)
    losses = []
    for k, b in enumerate(batches):
        r = eng.train_step(micro(b, eng))
        assert not r.skipped and math.isfinite(r.grad_norm) and r.grad_norm > 0
        assert r.step == k + 1 and r.tokens == 4 * (W.SEQ - 1)
        assert r.lr == pytest.approx(lr_at(k, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=3, max_steps=25), rel=1e-9)
        losses.append(r.loss)
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses
    assert eng.skipped_steps == 0 and eng.global_step == 25
    ev = eng.eval_step({"input_ids": batches[0]})
    assert math.isfinite(ev.loss) and ev.tokens == 4 * (W.SEQ - 1) and "ppl" in ev.metrics
    assert eng.module.training  # eval_step restores the mode


def test_bf16_keeps_fp32_master_weights_and_trains():
    cfg = W.make_config("bf16", lr=2e-2, warmup_steps=1, max_steps=12)
    eng = Engine(W.build_model(), cfg, W.loss_fn)
    assert all(p.dtype == torch.bfloat16 for p in eng.module.parameters())
    assert W.optimizer_shard_info(eng)["master_dtype"] == "torch.float32"
    losses = [eng.train_step(micro(b, eng)).loss for b in W.global_batches(12, 4)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed"])
def test_clipping_scales_the_step_to_the_global_norm(precision):
    """bf16 ZeRO-1 clips in the engine (hybridlm/engine/clipping.py), the others in DeepSpeed: the same result.
    After one step from a fresh AdamW its first moment is (1 - beta1) x the clipped gradient."""
    from hybridlm.engine.deepspeed_adapter import clips_in_engine, deepspeed_config

    cfg = W.make_config(precision, grad_clip=W.CLIP_TEST)
    assert clips_in_engine(cfg) == (precision == "bf16")
    assert deepspeed_config(cfg, 1)["gradient_clipping"] == (0.0 if precision == "bf16" else W.CLIP_TEST)
    engine = Engine(W.build_model(seed=0), cfg, W.loss_fn)
    # nor does DeepSpeed's throughput timer synchronize the device at every forward and step
    assert engine.ds_engine.tput_timer.config.enabled is False
    res = engine.train_step(micro(W.global_batches(1, cfg.global_batch_size)[0], engine))
    assert res.grad_norm > 10 * W.CLIP_TEST  # the norm DeepSpeed reports is the one before clipping
    assert W.first_moment_norm(engine) == pytest.approx(0.1 * W.CLIP_TEST, rel=1e-3)
    # below the threshold nothing is scaled: the first moment is 0.1 x the gradient itself
    loose = Engine(W.build_model(seed=0), W.make_config(precision, grad_clip=1e6), W.loss_fn)
    res = loose.train_step(micro(W.global_batches(1, cfg.global_batch_size)[0], loose))
    assert W.first_moment_norm(loose) == pytest.approx(0.1 * res.grad_norm, rel=2e-2 if precision == "bf16" else 1e-3)
    engine.ds_engine.destroy()
    loose.ds_engine.destroy()


def test_one_rank_bf16_skips_the_all_reduce_and_trains_the_same():
    """On one rank the bf16 optimizer's gradients need no all-reduce. DeepSpeed's would round the fp32 sums to its
    bf16 communication dtype and back: a no-op without accumulation (each sum is one bf16 gradient), so skipping
    it changes no bit there; with accumulation the sums now stay fp32."""
    cfg = W.make_config("bf16", global_batch_size=2)  # no accumulation
    assert cfg.gradient_accumulation_steps(1) == 1
    batches = W.global_batches(3, cfg.global_batch_size)
    runs = []
    for skip in (True, False):
        engine = Engine(W.build_model(seed=0), cfg, W.loss_fn)
        assert engine.ds_engine.enable_backward_allreduce is False
        engine.ds_engine.enable_backward_allreduce = not skip
        res = W.run(engine, batches, 0, 1, {})
        runs.append(([r.loss for r in res], [r.grad_norm for r in res], W.params_digest(engine.module)))
        engine.ds_engine.destroy()
    assert runs[0] == runs[1]
    fp32 = Engine(W.build_model(seed=0), W.make_config("fp32"), W.loss_fn)
    assert fp32.ds_engine.enable_backward_allreduce is True  # ZeRO's own optimizer fills its partitions there
    fp32.ds_engine.destroy()


@pytest.mark.parametrize("accumulate", [False, True], ids=["one_micro_batch", "accumulated"])
def test_bf16_norm_over_the_flat_gradients_is_deepspeeds_norm(accumulate):
    """The bf16 optimizer's gradient norm over its flat fp32 buffers (hybridlm/engine/deepspeed_adapter.py
    ``DeepSpeedAdapter.norm_over_flat_gradients``) is the norm DeepSpeed takes over each parameter's gradient: the same reported
    norms, losses and weights, up to the order of the fp32 sums."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    cfg = W.make_config("bf16", global_batch_size=4 if accumulate else 2)
    batches = W.global_batches(4, cfg.global_batch_size)
    runs = []
    for flat in (True, False):
        engine = Engine(W.build_model(seed=0), cfg, W.loss_fn)
        assert isinstance(engine.optimizer, BF16_Optimizer)
        if not flat:  # DeepSpeed's own method back
            engine.optimizer.get_grads_for_norm = BF16_Optimizer.get_grads_for_norm.__get__(engine.optimizer)
        res = W.run(engine, batches, 0, 1, {})
        runs.append(([r.loss for r in res], [r.grad_norm for r in res], W.params_digest(engine.module)))
        engine.ds_engine.destroy()
    (loss_a, norm_a, _), (loss_b, norm_b, _) = runs
    assert all(n > 0 for n in norm_a)
    assert norm_a == pytest.approx(norm_b, rel=1e-5) and loss_a == pytest.approx(loss_b, rel=1e-5)


def test_clip_by_global_norm_alone():
    from hybridlm.engine.clipping import clip_by_global_norm, clip_before_step

    grads = [torch.full((3,), 2.0), torch.full((4,), -1.0)]  # norm sqrt(12 + 4) = 4
    norm = clip_by_global_norm(grads, 1.0)
    assert float(norm) == pytest.approx(4.0)
    assert torch.allclose(torch.cat(grads).norm(), torch.tensor(1.0), atol=1e-5)
    before = [g.clone() for g in grads]
    assert float(clip_by_global_norm(grads, 5.0)) == pytest.approx(1.0, abs=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))  # x 1 exactly
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_before_step(torch.optim.SGD([p], lr=1.0), 0.0)
    opt = torch.optim.SGD([p], lr=1.0)
    clip_before_step(opt, 0.5)
    p.grad = torch.tensor([3.0, 4.0])
    opt.step()  # the pre-hook scales the gradient to norm 0.5 first
    assert torch.allclose(p.detach(), torch.tensor([-0.3, -0.4]))


def test_bf16_mixed_keeps_fp32_weights_and_runs_the_forward_in_bf16():
    """bf16-mixed: fp32 weights and optimizer, the forward (training and eval) under torch.autocast(bf16)."""
    cfg = W.make_config("bf16-mixed", lr=2e-2, warmup_steps=1, max_steps=12)
    eng = Engine(W.build_model(), cfg, W.loss_fn)
    assert all(p.dtype == torch.float32 for p in eng.module.parameters())
    assert W.optimizer_shard_info(eng)["master_dtype"] == "torch.float32"
    seen = []
    hook = eng.module.fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    batches = W.global_batches(12, 4)
    losses = [eng.train_step(micro(b, eng)).loss for b in batches]
    eng.eval_step({"input_ids": batches[0]})
    hook.remove()
    assert set(seen) == {torch.bfloat16} and len(seen) == 12 * 2 + 1  # two micro-batches a step, then eval
    assert losses[-1] < losses[0]
    fp32 = Engine(W.build_model(), W.make_config("fp32", lr=2e-2, warmup_steps=1, max_steps=12), W.loss_fn)
    # the same model and data in fp32 give a close but not identical first loss: the autocast is real
    first = fp32.train_step(micro(batches[0], fp32)).loss
    assert first == pytest.approx(losses[0], rel=2e-2) and first != losses[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_and_trainable_subsets(precision):
    model = W.build_model()
    model.emb.weight.requires_grad_(False)  # e.g. a frozen embedding table
    eng = Engine(model, W.make_config(precision), W.loss_fn)
    frozen_before = eng.module.emb.weight.detach().clone()  # after the bf16 cast
    head_before = eng.module.head.weight.detach().clone()
    for b in W.global_batches(2, 4):
        eng.train_step(micro(b, eng))
    assert torch.equal(eng.module.emb.weight, frozen_before)
    assert not torch.equal(eng.module.head.weight, head_before)

    # trainable=: only the head is optimised, everything else is frozen by the engine
    model = W.build_model()
    eng = Engine(model, W.make_config(precision), W.loss_fn, trainable=list(model.head.parameters()))
    fc1_before = eng.module.fc1.weight.detach().clone()
    head_before = eng.module.head.weight.detach().clone()
    for b in W.global_batches(2, 4):
        eng.train_step(micro(b, eng))
    assert torch.equal(eng.module.fc1.weight, fc1_before) and not eng.module.fc1.weight.requires_grad
    assert not torch.equal(eng.module.head.weight, head_before)
    info, head_numel = W.optimizer_shard_info(eng), sum(p.numel() for p in model.head.parameters())
    # fp32 master weights and AdamW state for the head alone (DeepSpeed may pad a flat group a little)
    assert info["trainable_numel"] == head_numel
    assert head_numel <= info["master_numel"] < head_numel + 64 and info["exp_avg_numel"] == info["master_numel"]


# ---------------------------------------------------------------------------- (b) NaN skipping


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_loss_skips_step_bit_identically(precision):
    cfg = W.make_config(precision, max_consecutive_nonfinite=3)
    eng = Engine(W.build_model(), cfg, W.loss_fn)
    batches = W.global_batches(10, 4)
    for b in batches[:2]:  # build real AdamW state first
        assert not eng.train_step(micro(b, eng)).skipped
    before = snapshot(eng)

    r = eng.train_step(micro(batches[2], eng, poison_rows=[3]))  # NaN in the 2nd micro-batch only
    assert r.skipped and math.isnan(r.loss) and r.lr == before["lr"][0]
    assert eng.skipped_steps == 1 and eng.consecutive_nonfinite == 1 and eng.global_step == 3
    assert_same(before, snapshot(eng))

    # a loss that is +inf through a constant term has finite gradients: still skipped
    def inf_loss(model, batch):
        loss, m = W.loss_fn(model, batch)
        return loss + torch.tensor(float("inf")), m

    eng.loss_fn = inf_loss
    assert eng.train_step(micro(batches[3], eng)).skipped
    assert_same(before, snapshot(eng))
    eng.loss_fn = W.loss_fn

    r = eng.train_step(micro(batches[4], eng))  # a healthy step resets the streak
    assert not r.skipped and eng.consecutive_nonfinite == 0 and eng.skipped_steps == 2
    after_good = snapshot(eng)
    assert not torch.equal(after_good["params"]["head.weight"], before["params"]["head.weight"])

    eng.train_step(micro(batches[5], eng, poison_rows=[0]))
    eng.train_step(micro(batches[6], eng, poison_rows=[0, 1, 2, 3]))
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        eng.train_step(micro(batches[7], eng, poison_rows=[2]))
    assert eng.skipped_steps == 5 and eng.consecutive_nonfinite == 3
    assert_same(after_good, snapshot(eng))  # the raising step was skipped too


def test_step_on_device_skips_as_deepspeed_does():
    """optim.step_on_device (DeepSpeedAdapter.step_on_device): the skip is decided on the device (fused AdamW's
    found_inf) and read with the results, and leaves the same state untouched: weights, fp32 masters, AdamW's
    moments and step count, the LR and its schedule."""
    cfg = W.make_config("bf16", max_consecutive_nonfinite=3, step_on_device=True)
    eng = Engine(W.build_model(), cfg, W.loss_fn)
    batches = W.global_batches(10, 4)
    for b in batches[:2]:
        assert not eng.train_step(micro(b, eng)).skipped
    before = snapshot(eng)
    pending = eng.launch_step(micro(batches[2], eng, poison_rows=[3]))
    assert pending.skipped is None  # not known on the host until read
    r = pending.result()
    assert r.skipped and math.isnan(r.loss) and r.lr == before["lr"][0]
    assert eng.skipped_steps == 1 and eng.consecutive_nonfinite == 1 and eng.global_step == 3
    assert_same(before, snapshot(eng))
    r = eng.train_step(micro(batches[3], eng))
    assert not r.skipped and eng.consecutive_nonfinite == 0 and r.lr == before["lr"][0]  # the skip kept the LR
    after_good = snapshot(eng)
    assert after_good["lr"][0] != before["lr"][0]  # an applied step advances it
    eng.train_step(micro(batches[4], eng, poison_rows=[0]))
    eng.train_step(micro(batches[5], eng, poison_rows=[1]))
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        eng.train_step(micro(batches[6], eng, poison_rows=[2]))
    assert eng.skipped_steps == 4 and eng.consecutive_nonfinite == 3
    assert_same(after_good, snapshot(eng))
    eng.ds_engine.destroy()


def test_step_on_device_trains_as_deepspeeds_step():
    """The same run (a NaN step in the middle) with DeepSpeed's step and with the step on the device: the same
    losses, norms and LRs, up to fused against foreach AdamW's rounding on the CPU. Steps launched back to back
    without reading: each reads the one before it before its optimizer, so the skip still holds the LR."""
    batches = W.global_batches(6, 4)
    poison = {2: [1]}
    runs = {}
    for on_device in (False, True):
        eng = Engine(W.build_model(), W.make_config("bf16", step_on_device=on_device), W.loss_fn)
        pending = [eng.launch_step(micro(b, eng, poison.get(k, ()))) for k, b in enumerate(batches)]
        runs[on_device] = [p.result() for p in pending]
        eng.ds_engine.destroy()
    ref, dev = runs[False], runs[True]
    assert [r.skipped for r in dev] == [r.skipped for r in ref] == [k in poison for k in range(6)]
    assert [r.lr for r in dev] == [r.lr for r in ref] and dev[3].lr == dev[2].lr
    ok = [k for k in range(6) if k not in poison]
    assert [dev[k].loss for k in ok] == pytest.approx([ref[k].loss for k in ok], rel=1e-4)
    assert [dev[k].grad_norm for k in ok] == pytest.approx([ref[k].grad_norm for k in ok], rel=1e-4)


def test_step_on_device_needs_deepspeeds_bf16_optimizer():
    with pytest.raises(ConfigError, match="optim.step_on_device: needs precision=bf16 and zero_stage=1"):
        build_dataclass(OptimConfig, {"micro_batch_size": 2, "global_batch_size": 4, "lr": 1e-3, "max_steps": 2,
                                      "precision": "fp32", "step_on_device": True}, "optim")


# ------------------------------------------------------------------------- (c) checkpoints


def test_checkpoint_round_trip_and_bitwise_resume(tmp_path):
    cfg = W.make_config("fp32", max_steps=12)
    batches = W.global_batches(8, 4)
    ref = Engine(W.build_model(seed=0), cfg, W.loss_fn)
    for b in batches[:4]:
        ref.train_step(micro(b, ref))
    ref.train_step(micro(batches[4], ref, poison_rows=[0]))  # a skipped step is part of the state
    path = ref.save_checkpoint(tmp_path / "ck", 5, {"data_position": 5, "note": "x"})
    assert os.path.basename(path) == "step_5"
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_5"
    at_save = snapshot(ref)
    rng_at_save = get_rng_state()
    ref_results = [ref.train_step(micro(b, ref)) for b in batches[5:]]
    ref_final = snapshot(ref)

    # a fresh engine with different weights and scrambled RNG restores everything exactly
    eng = Engine(W.build_model(seed=7), cfg, W.loss_fn)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    client = eng.load_checkpoint(tmp_path / "ck")
    assert client == {"data_position": 5, "note": "x"}
    assert (eng.global_step, eng.skipped_steps, eng.consecutive_nonfinite) == (5, 1, 1)
    assert_same(at_save, snapshot(eng))
    assert rng_equal(rng_at_save, get_rng_state())

    results = [eng.train_step(micro(b, eng)) for b in batches[5:]]
    assert [r.loss for r in results] == [r.loss for r in ref_results]  # bitwise
    assert [r.grad_norm for r in results] == [r.grad_norm for r in ref_results]
    assert [r.lr for r in results] == [r.lr for r in ref_results]
    assert_same(ref_final, snapshot(eng))

    # loading a specific step directory works too
    assert Engine(W.build_model(seed=3), cfg, W.loss_fn).load_checkpoint(path) == client


def test_crash_during_save_keeps_previous_checkpoint_and_keep_last(tmp_path):
    cfg = W.make_config("fp32")
    eng = Engine(W.build_model(), cfg, W.loss_fn)
    batches = W.global_batches(9, 4)
    ck = tmp_path / "ck"
    eng.train_step(micro(batches[0], eng))
    eng.train_step(micro(batches[1], eng))
    eng.save_checkpoint(ck, 2, {"step": 2})
    good = snapshot(eng)
    eng.train_step(micro(batches[2], eng))

    # the save dies half-way (the client state cannot be pickled): step_2 stays the latest
    with pytest.raises(Exception):
        eng.save_checkpoint(ck, 3, {"step": 3, "bad": lambda: None})
    assert (ck / "latest").read_text().strip() == "step_2"
    assert not (ck / "step_3").exists() and (ck / ".tmp_step_3").exists()  # the debris of the dead save
    assert eng.load_checkpoint(ck) == {"step": 2} and eng.global_step == 2
    assert_same(good, snapshot(eng))

    # the next save clears the debris; keep_last prunes older checkpoints, never the new one
    for k, b in enumerate(batches[2:6], start=3):
        eng.train_step(micro(b, eng))
        eng.save_checkpoint(ck, k, {"step": k}, keep_last=2)
    names = sorted(p.name for p in ck.iterdir())
    assert [n for n in names if n.startswith("step_")] == ["step_5", "step_6"], names
    assert not any(n.startswith((".tmp_", ".trash_")) for n in names), names
    assert (ck / "latest").read_text().strip() == "step_6"

    # a leftover temporary from a killed save is ignored by load
    (ck / ".tmp_step_7").mkdir()
    (ck / ".tmp_step_7" / "junk.pt").write_bytes(b"\0" * 10)
    assert eng.load_checkpoint(ck) == {"step": 6} and eng.global_step == 6


class _RunsCode:
    """A pickle that runs a command when unpickled with weights_only=False."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["rng_state_rank00000.pt", "mp_rank_00_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_planted_pickle_is_refused_not_run(tmp_path, victim):
    """Every file a resume reads (ours and DeepSpeed's) is unpickled with weights_only=True: a file that would
    run code is named in one line and nothing runs."""
    eng = Engine(W.build_model(), W.make_config("fp32"), W.loss_fn)
    eng.train_step(micro(W.global_batches(1, 4)[0], eng))
    ck = tmp_path / "ck"
    eng.save_checkpoint(ck, 1, {"data": {"epoch": 0, "position": 4}})
    fresh = Engine(W.build_model(seed=3), W.make_config("fp32"), W.loss_fn)
    assert fresh.load_checkpoint(ck) == {"data": {"epoch": 0, "position": 4}}  # the genuine one loads
    marker = tmp_path / "code_ran"
    torch.save({"state": _RunsCode(marker)}, ck / "step_1" / victim)
    manifest = json.loads((ck / "step_1" / "manifest.json").read_text())  # a crafted folder fixes sizes and digests
    manifest["files"][victim] = (ck / "step_1" / victim).stat().st_size
    manifest["sha256"][victim] = hashlib.sha256((ck / "step_1" / victim).read_bytes()).hexdigest()
    (ck / "step_1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as e:
        fresh.load_checkpoint(ck)
    msg = str(e.value)
    assert "\n" not in msg and victim in msg and "system" in msg and "refusing to unpickle" in msg, msg
    assert not marker.exists()


def test_missing_or_corrupt_checkpoint_is_a_one_line_error(tmp_path):
    eng = Engine(W.build_model(), W.make_config("fp32"), W.loss_fn)

    def one_line(exc_info, *needles):
        msg = str(exc_info.value)
        assert "\n" not in msg and isinstance(exc_info.value, ConfigError)
        for n in needles:
            assert n in msg, msg

    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError) as e:
        eng.load_checkpoint(missing)
    one_line(e, str(missing))

    empty = tmp_path / "empty"
    empty.mkdir()
    assert eng.load_checkpoint(empty) is None  # a fresh output dir: nothing to resume
    with pytest.raises(CheckpointError) as e:
        eng.load_checkpoint(empty, required=True)
    one_line(e, str(empty))

    ck = tmp_path / "ck"
    eng.train_step(micro(W.global_batches(1, 4)[0], eng))
    eng.save_checkpoint(ck, 1, {})
    (ck / "latest").write_text("step_9\n")
    with pytest.raises(CheckpointError) as e:
        eng.load_checkpoint(ck)
    one_line(e, str(ck), "step_9")
    (ck / "latest").write_text("step_1\n")

    model_file = ck / "step_1" / "mp_rank_00_model_states.pt"
    data = model_file.read_bytes()
    model_file.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError) as e:
        eng.load_checkpoint(ck)
    one_line(e, str(ck / "step_1"), "mp_rank_00_model_states.pt")

    model_file.write_bytes(b"x" * len(data))  # right size, garbage content: its sha256 differs
    with pytest.raises(CheckpointError) as e:
        eng.load_checkpoint(ck)
    one_line(e, str(ck / "step_1"), "mp_rank_00_model_states.pt", "sha256")

    (ck / "step_1" / "manifest.json").unlink()  # a save that never finished
    with pytest.raises(CheckpointError) as e:
        eng.load_checkpoint(ck / "step_1")
    one_line(e, "incomplete")


def test_distributed_helpers_single_process():
    assert is_main()
    assert all_reduce_flag(True) is True and all_reduce_flag(False) is False
    assert all_reduce_sum([1, 2.5]) == [1.0, 2.5]


# ------------------------------------------------------------------ (e) two ranks, ZeRO-1 on CPU


def assert_no_gloo_threads_after_shutdown(out_dir, ranks=(0, 1)):
    """Each rank of the worker wrote the threads it had left after ``shutdown_distributed()``: none may be a gloo
    thread (a group still alive then is freed during interpreter teardown, where its threads can abort the rank)."""
    for r in ranks:
        with open(os.path.join(out_dir, f"rank{r}_teardown.json")) as f:
            names = json.load(f)["threads_after_shutdown"]
        gloo = [n for n in names if n in W.GLOO_THREADS]
        assert gloo == [], f"rank {r}: {len(gloo)} gloo threads after shutdown_distributed(): {names}"


@pytest.mark.timeout(300)
# bf16 on 2 CPU ranks once aborted at exit in some CI runs ("terminate called without an active exception": gloo
# threads of a group still referenced at interpreter teardown); the worker now releases its engines and tears the
# groups down through DeepSpeed's comm layer (hybridlm/engine/distributed.py), and each rank must have no gloo thread
# left after shutdown_distributed() (docs/distributed_teardown.md). BENCHMARKS.md, "Test suites", has the
# repetition counts.
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-device"])  # bf16-device: optim.step_on_device
def test_two_rank_zero1_shards_state_and_matches_one_rank(tmp_path, precision):
    env = subprocess_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           WORKER_PATH, "--out", str(tmp_path), "--precision", precision, "--steps", "6", "--save-at", "3",
           "--nan-step", "2"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert_no_gloo_threads_after_shutdown(tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    for d in ranks:
        assert d["world_size"] == 2 and d["backend"] == "gloo" and d["gradient_accumulation_steps"] == 1
        assert d["is_main"] == (d["rank"] == 0)
        assert d["flag_any"] is True and d["flag_none"] is False and d["sum"] == [1.0, 2.0]
        s = d["shard"]
        total = s["trainable_numel"]
        # ZeRO-1: each rank holds about half of the fp32 master weights and of the AdamW moments
        assert s["master_dtype"] == "torch.float32"
        assert total / 2 <= s["master_numel"] <= total / 2 + 64, s
        assert s["exp_avg_numel"] == s["exp_avg_sq_numel"] == s["master_numel"], s
        # the NaN on rank 1 alone skipped step index 2 on both ranks
        assert d["skipped"] == [False, False, True, False, False, False] and d["skipped_steps"] == 1
        assert d["resumed_client_state"] == {"where": "worker"}
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in d["ckpt_files"] or \
            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in d["ckpt_files"]
    r0, r1 = ranks
    # clipping by the norm over both ranks' partitions (bf16: the engine's own clipping, fp32: DeepSpeed's)
    assert r0["clip"] == r1["clip"] and r0["clip"]["grad_norm"] > 10 * W.CLIP_TEST
    assert r0["clip"]["first_moment_norm"] == pytest.approx(0.1 * W.CLIP_TEST, rel=1e-3)
    assert r0["params_digest"] == r1["params_digest"]  # replicas bit-identical
    assert r0["losses"][:2] == r1["losses"][:2] and r0["losses"][3:] == r1["losses"][3:]
    # resuming the 2-rank checkpoint in fresh engines continues bitwise identically
    assert r0["resumed_losses"] == r0["losses"][3:] and r0["resumed_params_digest"] == r0["params_digest"]

    # one rank, same global batch through 2 micro-batches of gradient accumulation
    cfg = W.make_config(precision)
    eng = Engine(W.build_model(seed=0), cfg, W.loss_fn)
    assert eng.gradient_accumulation_steps == 2
    batches = W.global_batches(6, cfg.global_batch_size)
    single = W.run(eng, batches, 0, 1, {2: [2, 3]})
    tol = 1e-5 if precision == "fp32" else 2e-2
    for k, (a, b) in enumerate(zip([r.loss for r in single], r0["losses"])):
        if k == 2:
            assert math.isnan(a) and math.isnan(b) and single[k].skipped
        else:
            assert a == pytest.approx(b, rel=tol), (k, a, b)
    assert [r.tokens for r in single] == r0["tokens"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_on_another_number_of_ranks_continues_the_run(tmp_path, precision):
    """Elastic resume: a checkpoint of 2 ranks resumes on 1 and one of 1 on 2 (gloo, ZeRO-1). The optimizer
    state is re-partitioned exactly (copied); the same global batches are split differently (1 rank
    accumulates two micro-batches where 2 ranks average theirs), so the losses agree to float rounding of the
    gradient sums, not bitwise."""
    cfg = W.make_config(precision)
    steps, save_at = 6, 3
    batches = W.global_batches(steps, cfg.global_batch_size)
    ref = Engine(W.build_model(seed=0), cfg, W.loss_fn)  # one rank, uninterrupted
    ref_losses = [ref.train_step(micro(b, ref)).loss for b in batches]
    tol = 1e-5 if precision == "fp32" else 2e-2

    def torchrun(*extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), WORKER_PATH, "--precision",
               precision, "--steps", str(steps), "--save-at", str(save_at), "--nan-step", "-1", *extra]
        proc = subprocess.run(cmd, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert_no_gloo_threads_after_shutdown(extra[extra.index("--out") + 1])

    # 2 -> 1: the worker trains 3 steps on 2 ranks and saves (then goes on; its checkpoint is what counts)
    two = tmp_path / "two"
    two.mkdir()
    torchrun("--out", str(two))
    assert json.loads((two / "ckpt" / "step_3" / "manifest.json").read_text())["world_size"] == 2
    one = Engine(W.build_model(seed=5), cfg, W.loss_fn)
    assert one.load_checkpoint(two / "ckpt") == {"where": "worker"} and one.global_step == save_at
    resumed = [one.train_step(micro(b, one)).loss for b in batches[save_at:]]
    assert resumed == pytest.approx(ref_losses[save_at:], rel=tol)

    # 1 -> 2: one rank trains 3 steps and saves, two ranks resume
    first = Engine(W.build_model(seed=0), cfg, W.loss_fn)
    for b in batches[:save_at]:
        first.train_step(micro(b, first))
    first.save_checkpoint(tmp_path / "from_one", save_at, {"where": "one rank"})
    out = tmp_path / "resumed_on_two"
    out.mkdir()
    torchrun("--out", str(out), "--resume-from", str(tmp_path / "from_one"))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for d in ranks:
        assert d["world_size"] == 2 and d["client"] == {"where": "one rank"} and d["global_step"] == steps
        assert d["losses"] == pytest.approx(ref_losses[save_at:], rel=tol)
    assert ranks[0]["params_digest"] == ranks[1]["params_digest"]  # both ranks hold the same model


def test_activation_checkpointing_trains_the_same_model():
    """Recomputing blocks in the backward pass changes memory, not the step: same losses, same weights."""
    from conftest import tiny_config
    from hybridlm.model import HybridForCausalLM

    def lm_loss(model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss, {}

    ids = torch.randint(0, 512, (4, 40), generator=torch.Generator().manual_seed(3))
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = HybridForCausalLM(tiny_config())
        cfg = OptimConfig(micro_batch_size=2, global_batch_size=4, lr=1e-2, max_steps=3, precision="fp32",
                          activation_checkpointing=checkpointing)
        engine = Engine(model, cfg, lm_loss)
        # the first block's mixer (the block itself is not called where the residual adds go into the norms)
        calls, mixer = [], engine.module.model.layers[0].mixer
        forward = mixer.forward  # counted in place of a hook: torch's recomputation does not run module hooks
        mixer.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]
        losses = [engine.train_step([{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]).loss for _ in range(3)]
        assert len(calls) == (12 if checkpointing else 6)  # 3 steps x 2 micro-batches, recomputed in backward
        runs.append((losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}))
        engine.ds_engine.destroy()
    (plain_losses, plain), (ckpt_losses, ckpt) = runs
    assert ckpt_losses == pytest.approx(plain_losses, rel=1e-6)
    assert all(torch.allclose(ckpt[n], plain[n], rtol=1e-5, atol=1e-6) for n in plain)
    with pytest.raises(ConfigError, match="optim.activation_checkpointing: expected true or false"):
        OptimConfig(micro_batch_size=2, global_batch_size=4, lr=1e-2, max_steps=3,
                    activation_checkpointing="yes").validate()
