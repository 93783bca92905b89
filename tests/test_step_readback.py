"""Reading a step's results one step late: the Readback (hybridlm/utils/readback.py), Engine.launch_step and the
training loop's order of launches and reads (hybridlm/training/loop.py)."""
import importlib.util
import json
import math
import os

import pytest
import torch

from hybridlm.data.sampler import ShuffledBatches
from hybridlm.engine import Engine, NonFiniteLossError, init_distributed
from hybridlm.training import RunConfig, train_loop
from hybridlm.training.loop import _StepPipeline
from hybridlm.utils.readback import Readback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("engine_worker", os.path.join(REPO, "tests", "engine_worker.py"))
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


@pytest.fixture(scope="module", autouse=True)
def _one_process_world():
    init_distributed()
    yield


def micro(batch, engine, poison_rows=()):
    return W.local_micro_batches(batch, 0, 1, engine.config.micro_batch_size, poison_rows)


def test_a_readback_holds_the_values_of_when_it_was_made():
    t = torch.tensor([1.5, 2.0, -3.0], dtype=torch.float64)
    rb = Readback(t)
    t.mul_(10)  # later work on the tensor does not reach what was read back
    assert rb.ready() and rb.tolist() == [1.5, 2.0, -3.0]
    assert rb.tolist() is rb.tolist()  # read once


def test_launch_step_gives_train_step_results_and_knows_a_skip_at_once():
    cfg = W.make_config("fp32", max_steps=6)
    batches = W.global_batches(6, cfg.global_batch_size)
    sync = Engine(W.build_model(), cfg, W.loss_fn)
    late = Engine(W.build_model(), cfg, W.loss_fn)
    expected = [sync.train_step(micro(b, sync)) for b in batches[:3]]
    late.module.eval()  # a step puts a model left in eval mode back in training mode
    assert late.ds_engine.training  # (DeepSpeed's own flag does not follow its module's)
    # launched back to back, read afterwards: the same results, bit for bit
    pending = [late.launch_step(micro(b, late)) for b in batches[:3]]
    assert late.module.training
    for p, r in zip(pending, expected):
        got = p.result()
        assert (got.step, got.loss, got.grad_norm, got.lr, got.tokens, got.metrics) == \
               (r.step, r.loss, r.grad_norm, r.lr, r.tokens, r.metrics)
    # a NaN step: skipped, counted, before anything is read
    p = late.launch_step(micro(batches[3], late, poison_rows=[0]))
    assert p.skipped and late.skipped_steps == 1 and late.consecutive_nonfinite == 1
    assert math.isnan(p.result().loss) and p.result().skipped
    late.launch_step(micro(batches[4], late, poison_rows=[1]))
    with pytest.raises(NonFiniteLossError, match="3 consecutive optimizer steps skipped"):
        late.launch_step(micro(batches[5], late, poison_rows=[2]))


class Stream(ShuffledBatches):
    """The project's sampler over the worker's tiny sequences."""

    def __init__(self):
        super().__init__(64, 2, 0, 1, seed=5, too_few="too few")
        self.rows = torch.cat(W.global_batches(16, 4))

    def make_batch(self, indices):
        return {"input_ids": self.rows[torch.as_tensor(indices)]}


def test_the_loop_reads_each_step_after_launching_the_next(tmp_path):
    """The loop reads step k's results once step k + 1's backward is launched (while DeepSpeed's norm check waits
    for the GPU), except where something at step k's end needs them first: the process's first step (the
    cold-start clock), an evaluation, a checkpoint, the last step. The log holds every step as before."""
    events = []

    def loss_fn(model, batch):  # one micro-batch a step: the n-th training call is step n's forward
        if torch.is_grad_enabled():  # eval_step runs without gradients
            events.append(f"T{sum(e.startswith('T') for e in events) + 1}")
        elif not events or events[-1] != "E":
            events.append("E")  # an evaluation (one entry for its batches)
        return W.loss_fn(model, batch)

    cfg = W.make_config("fp32", max_steps=7, global_batch_size=2)
    engine = Engine(W.build_model(), cfg, loss_fn)
    run = RunConfig(output_dir=str(tmp_path / "run"), eval_interval=4, save_interval=5, progress=False,
                    tensorboard=False, export=False, sample_tokens=0)
    val = [{"input_ids": b} for b in W.global_batches(2, 2, seed=9)]
    out = train_loop(engine, Stream(), run, val, on_step=lambda r: events.append(f"R{r.step}"))
    # T: a step's forward, R: its results read, E: an evaluation
    assert events == ["T1", "R1",              # the first step: read at once
                      "T2", "T3", "R2",        # read once the next step's backward is launched
                      "T4", "R3", "R4", "E",   # step 4 ends with an evaluation
                      "T5", "R5",              # step 5 with a checkpoint
                      "T6", "T7", "R6", "R7",  # the last step
                      "E"], " ".join(events)    # the final evaluation
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 8))
    # tokens/s from each step's own time, whether it was read at once or late, an evaluation before it or not
    for r in (r for r in logged if "loss" in r):
        assert r["step_seconds"] > 0 and r["tokens_per_s"] == pytest.approx(2 * (W.SEQ - 1) / r["step_seconds"])
    assert out.steps == 7 and out.tokens == 7 * 2 * (W.SEQ - 1) and math.isfinite(out.final_loss)
    assert out.final_loss == [r for r in logged if "loss" in r][-1]["loss"]


def test_the_step_pipeline_reads_the_step_before_during_a_launch_and_again_after_a_failed_read():
    """``_StepPipeline``: a launch reads the pending step while the new one's backward runs (after asking for the
    next batches), ``settle()`` reads it at once, and a read that raises leaves the step pending."""
    events, fail = [], {2}

    class Pending:
        def __init__(self, step):
            self.step = step

    class FakeEngine:
        gradient_accumulation_steps = 3

        def __init__(self):
            self.step = 0

        def launch_step(self, micro, before_optimizer_step):
            self.step += 1
            events.append(f"T{self.step}")
            before_optimizer_step()
            return Pending(self.step)

    class Batches:
        def request(self, n):
            events.append(f"Q{n}")

    class Book:
        def settle(self, pending):
            if pending.step in fail:
                fail.discard(pending.step)
                raise NonFiniteLossError(f"step {pending.step}")
            events.append(f"R{pending.step}")

    steps = _StepPipeline(FakeEngine(), Batches(), Book())
    steps.settle()  # nothing pending: nothing read
    assert not steps.pending
    assert steps.launch([{}] * 3) == 1 and steps.pending
    steps.settle()
    assert not steps.pending
    assert steps.launch([]) == 2
    with pytest.raises(NonFiniteLossError):
        steps.launch([])  # step 3's launch reads step 2, which raises
    assert steps.pending
    steps.settle()  # step 2 read again
    assert not steps.pending
    assert steps.launch([]) == 4 and steps.launch([]) == 5 and steps.pending
    steps.settle()
    assert events == ["T1", "Q3", "R1", "T2", "Q3", "T3", "Q3", "R2", "T4", "Q3", "T5", "Q3", "R4", "R5"], events


@pytest.mark.parametrize("on_device", [False, True], ids=["deepspeed_step", "step_on_device"])
def test_the_loop_logs_a_skipped_step_and_saves_before_stopping(tmp_path, on_device):
    """A NaN step read one step late is logged as skipped; too many in a row stop the run with a checkpoint, with
    DeepSpeed's step (the skip known at launch) and with the step on the device (known when read)."""
    def nan_at(steps):
        def loss_fn(model, batch):  # one micro-batch a step: the n-th training call is step n
            loss, metrics = W.loss_fn(model, batch)
            if torch.is_grad_enabled():
                loss_fn.calls += 1
                if loss_fn.calls in steps:
                    loss = loss * float("nan")
            return loss, metrics
        loss_fn.calls = 0
        return loss_fn

    run = RunConfig(output_dir=str(tmp_path / "run"), eval_interval=0, save_interval=0, progress=False,
                    tensorboard=False, export=False, sample_tokens=0)
    cfg = W.make_config("bf16", max_steps=6, global_batch_size=2, step_on_device=on_device,
                        max_consecutive_nonfinite=2)
    out = train_loop(Engine(W.build_model(), cfg, nan_at({3})), Stream(), run)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in logged if "loss" in r] == [0, 0, 1, 0, 0, 0]
    assert out.skipped_steps == 1 and math.isfinite(out.final_loss)

    run.output_dir = str(tmp_path / "stopped")
    engine = Engine(W.build_model(), cfg, nan_at({4, 5}))
    with pytest.raises(NonFiniteLossError, match="2 consecutive .* checkpoint saved"):
        train_loop(engine, Stream(), run)
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == "step_5"
    assert engine.skipped_steps == 2
