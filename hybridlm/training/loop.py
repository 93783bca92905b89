"""Steps, progress, logs, evaluation, checkpoints and resume, for any stage.

A stage supplies the :class:`~hybridlm.engine.Engine` (model + loss), a resumable batch iterator
(``next()``, ``state_dict()``, ``load_state_dict()``) and optional validation batches; the loop does
the rest: a progress bar with tokens/s and ETA, JSONL + TensorBoard logs, periodic validation
(loss and perplexity), atomic checkpoints every ``save_interval`` steps and at the end, resume from
the latest checkpoint, and a saved checkpoint before stopping on repeated non-finite losses or on a
pre-emption signal (SIGTERM / SIGUSR1, recorded by hybridlm/training/preempt.py's ``STOP`` and asked here after
every step).
"""
from __future__ import annotations

import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting
from hybridlm.data.prefetch import Prefetcher
from hybridlm.engine import (Engine, NonFiniteLossError, PendingStep, StepResult, all_reduce_sum, barrier,
                             is_main)
from hybridlm.training.cold_start import first_step_done, first_step_notice
from hybridlm.training.preempt import STOP, Preempted
from hybridlm.utils.faults import kill_if_requested
from hybridlm.utils.metrics import MetricsLogger, plot_curves, read_jsonl


@dataclass
class RunConfig(Section):
    """The ``run:`` section: where outputs go and how often to log, evaluate and save."""
    output_dir: str = setting("runs/default", nonempty="a directory path")
    log_interval: int = setting(1, ge=1)
    eval_interval: int = setting(100, ge=0)      # 0: only at the end
    save_interval: int = setting(200, ge=0)      # 0: only at the end
    keep_last: int = setting(2, ge=1)
    resume: bool = True           # continue from output_dir/checkpoints/latest when present
    progress: bool = True
    tensorboard: bool = True
    export: bool = True           # transformers-format model in output_dir/final
    remote_code: bool = False     # also write hybrid_lm_auto.py + an auto_map into final/, so it loads with
                                  # trust_remote_code=True without `import hybridlm.model` (which runs that .py);
                                  # only for sharing with people who do not use the toolkit
    sample_prompt: str = "It is a truth universally acknowledged"
    sample_tokens: int = setting(24, ge=0)       # new tokens of the end-of-run sample (pre-training); 0: no sample
    sample_temperature: float = setting(0.8, ge=0)   # 0: greedy
    sample_top_k: int = setting(50, ge=0)            # 0: the whole vocabulary
    sample_seed: int = 0
    sample_no_repeat_ngram: int = setting(3, ge=0)   # no n-gram of this size twice in the sample; 0: no guard
    # stop (evaluate, save, export) after this much training time, counted from the end of the first step
    # (compilation, autotuning); 0: no limit
    max_minutes: float = setting(0.0, ge=0)
    # intra-op threads of a run on the CPU (torch.set_num_threads); 0: torch's default, one per core. A small
    # model's ops are short: with one thread per core, another job on the machine stalls every op's join, and a
    # step slows far past the run's share of the cores (BENCHMARKS.md, "Test suites")
    cpu_threads: int = setting(0, ge=0)

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.sample_tokens and not self.sample_prompt.strip():
            raise ConfigError(f"{where}.sample_prompt: expected text for the end-of-run sample to continue (or "
                              f"{where}.sample_tokens=0 for no sample)")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"


@dataclass
class TrainingOutcome:
    steps: int
    tokens: int
    final_loss: Optional[float]   # None: no step logged a finite loss
    val_loss: Optional[float]
    skipped_steps: int
    max_loss_increase: float
    seconds: float
    # training seconds per step after this process's first step (which carries compilation and Triton
    # autotuning); None when fewer than two steps ran here
    seconds_per_step: Optional[float] = None
    history: List[Dict[str, Any]] = field(default_factory=list)
    val: Dict[str, float] = field(default_factory=dict)  # the final evaluation (evaluate's keys)


def evaluate(engine: Engine, batches: Sequence[Dict[str, Any]], loss_is_nll: bool = True) -> Dict[str, float]:
    """Validation means over all ranks: ``val_loss`` and ``val_<name>`` of every metric the loss returns, weighted
    by tokens or by the loss's own ``eval_weight`` (DPO: pairs), ``val_count`` the total weight, and the
    perplexity when the loss is a next-token NLL (a distillation loss's exp means nothing: ILD's sum of norms
    gave 'val_ppl 5e21')."""
    keys: List[str] = []
    sums: List[float] = [0.0, 0.0]  # loss, weight, then one per metric
    for batch in batches:
        r = engine.eval_step(batch)
        if not keys and r.metrics:
            keys = sorted(r.metrics)
            sums += [0.0] * len(keys)
        w = r.weight if r.weight is not None else r.tokens
        sums[0] += r.loss * w
        sums[1] += w
        for j, k in enumerate(keys):
            sums[2 + j] += r.metrics.get(k, 0.0) * w
    # every rank evaluates (the same metric names) so that the reduction lines up
    sums = all_reduce_sum(sums)
    total = max(sums[1], 1e-12)
    out = {"val_loss": sums[0] / total, **{f"val_{k}": sums[2 + j] / total for j, k in enumerate(keys)},
           "val_count": sums[1]}
    if loss_is_nll:
        out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
    return out


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0, desc="train")


def _should_stop(t_steady: Optional[float], max_minutes: float):
    """(time budget spent, pre-emption signal received), agreed by all ranks in one collective: the budget
    by rank 0's clock, the signal if any rank got one, so that every rank stops at the same step. The budget
    counts from the end of the first step: a cold machine's compilation and autotuning (minutes for a new
    shape) must not eat a stage's steps."""
    spent = float(bool(max_minutes) and t_steady is not None and is_main()
                  and time.perf_counter() - t_steady >= 60.0 * max_minutes)
    spent, signalled = all_reduce_sum([spent, float(STOP.requested)])
    if signalled and not STOP.requested:  # every rank stops at this step, and after the commits that follow it
        STOP.record("a signal on another rank")
    return spent > 0, signalled > 0


class _StepBook:
    """What the loop does with a step's results once they are read: counters, logs, the progress bar,
    ``on_step`` and the clock. Reading them is what waits for the GPU, so the loop reads a step after it has
    launched the next one, unless something at that step's end (evaluation, a checkpoint, a stop) needs them."""

    def __init__(self, state: Dict[str, Any], logger: MetricsLogger, bar, run: RunConfig, max_steps: int,
                 on_step: Optional[Callable[[StepResult], None]], say: Optional[Callable[[str], None]], device):
        self.state, self.logger, self.bar, self.run, self.max_steps = state, logger, bar, run, max_steps
        self.on_step, self.say, self.device = on_step, say, device
        self.t_start = self.t_mark = time.perf_counter()  # t_mark: the last step's end (time is summed per step)
        self.t_steady: Optional[float] = None  # the end of this process's first step (compilation, autotuning)
        self.steady_steps = 0                  # steps launched since
        self.window_tokens, self.window_seconds = 0, 0.0  # tokens/s over the steps since the last log line
        self.first_step: Optional[int] = None
        self.last: Dict[str, Any] = {}

    def restart_window(self) -> None:
        self.window_tokens, self.window_seconds = 0, 0.0

    def count_launched(self, step: int) -> None:
        if self.t_steady is not None and step != self.first_step:
            self.steady_steps += 1

    def seconds_per_step(self) -> Optional[float]:
        """Training seconds per step after this process's first; None when fewer than two steps ran here."""
        return (self.t_mark - self.t_steady) / self.steady_steps if self.steady_steps else None

    def settle(self, pending: PendingStep) -> StepResult:
        res = pending.result()
        state, run = self.state, self.run
        state["tokens"] += res.tokens
        # each step's own time on the device: a step read late or at once, an evaluation between, all count alike
        self.window_tokens += res.tokens
        self.window_seconds += res.seconds
        if not res.skipped:
            if state["prev_loss"] is not None:
                state["max_loss_increase"] = max(state["max_loss_increase"], res.loss - state["prev_loss"])
            state["prev_loss"] = res.loss
        tok_s = self.window_tokens / max(self.window_seconds, 1e-9)
        self.last = {"loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm, "skipped": int(res.skipped),
                     "skipped_total": pending.skipped_total, "tokens": state["tokens"], "tokens_per_s": tok_s,
                     "step_seconds": res.seconds,
                     "max_loss_increase": state["max_loss_increase"], **res.metrics}
        if res.step % run.log_interval == 0 or res.step == self.max_steps:
            self.logger.log(res.step, self.last)
            self.restart_window()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{res.loss:.4f}", lr=f"{res.lr:.2e}", tok_s=f"{tok_s:,.0f}")
        if self.on_step is not None:
            self.on_step(res)
        now = time.perf_counter()
        state["seconds"] += now - self.t_mark
        self.t_mark = now
        if self.t_steady is None:
            self.t_steady, self.first_step = now, res.step
            done = first_step_done(self.device, now - self.t_start) if self.say else None
            if done:
                self.say(done)
        return res


class _StepPipeline:
    """The optimizer steps in flight: at most one launched whose results are not read yet, and the
    :class:`_StepBook` that takes them when read. :meth:`launch` reads the step before while the new step's
    backward runs (so the host launches the next forward at once after the optimizer step); :meth:`settle` reads
    the pending step now, for what needs its results first (the first step, an evaluation, a checkpoint, a stop,
    the loop's end)."""

    def __init__(self, engine: Engine, batches: Prefetcher, book: _StepBook):
        self.engine, self.batches, self.book = engine, batches, book
        self._pending: Optional[PendingStep] = None  # launched, its results not read yet

    @property
    def pending(self) -> bool:
        """Whether a launched step's results are not read yet."""
        return self._pending is not None

    def launch(self, micro: List[Dict[str, Any]]) -> int:
        """Launch an optimizer step over the micro-batches ``micro``; returns its step number."""
        self._pending = self.engine.launch_step(micro, before_optimizer_step=self._while_the_backward_runs)
        return self._pending.step

    def settle(self) -> None:
        """Read the pending step's results into the book, if a step is pending. A read that raises (a non-finite
        loss counted when read) leaves the step pending, to be read again."""
        if self._pending is not None:
            self.book.settle(self._pending)
            self._pending = None

    def _while_the_backward_runs(self) -> None:
        """Host work done once a step's backward is launched, while DeepSpeed's norm check waits for the GPU:
        ask for the next batches, and read the step before (done long since)."""
        self.batches.request(self.engine.gradient_accumulation_steps)
        self.settle()


def train_loop(engine: Engine, train_batches, run: RunConfig, val_batches: Sequence[Dict[str, Any]] = (),
               client_state: Optional[Dict[str, Any]] = None, title: str = "",
               on_step: Optional[Callable[[StepResult], None]] = None,
               checkpoints: bool = True, loss_is_nll: bool = True) -> TrainingOutcome:
    """Train until ``engine.config.max_steps`` optimizer steps (resuming if a checkpoint exists).

    ``on_step(result)``, if given, is called when a step's results are read, after its logging; that is
    after the next step is launched, unless the step ends with an evaluation, a checkpoint or a stop, whose
    results are read before those (e.g. to time steps: the call comes when the GPU has finished the step).
    ``checkpoints=False`` neither resumes nor saves (benchmarks: a ZeRO checkpoint of a 1B model is tens of GB).
    ``loss_is_nll=False`` (distillation and preference losses) logs no validation perplexity.
    """
    if run.cpu_threads and engine.device.type == "cpu":
        torch.set_num_threads(run.cpu_threads)
    max_steps = engine.config.max_steps
    gas = engine.gradient_accumulation_steps
    main = is_main()
    out = Path(run.output_dir)
    # "seconds": training time summed over every process of the run (resumes included), kept in the checkpoint
    state = {"tokens": 0, "max_loss_increase": 0.0, "prev_loss": None, "seconds": 0.0}
    resumed = (engine.load_checkpoint(str(run.checkpoint_dir))
               if checkpoints and run.resume and run.checkpoint_dir.exists() else None)
    if resumed:
        train_batches.load_state_dict(resumed["data"])
        state.update(resumed["loop"])
        if main:
            print(f"resumed from {run.checkpoint_dir} at step {engine.global_step}", flush=True)
            if engine.resume_note:
                print(engine.resume_note, flush=True)
    logger = MetricsLogger(out, enabled=main, resume_step=engine.global_step, tensorboard=run.tensorboard)
    resources = ExitStack()
    if not STOP.installed:  # called from Python, outside a CLI and a run shell: the loop owns the signals meanwhile
        STOP.install()
        resources.callback(STOP.uninstall)
    # the next step's batches are made while the GPU runs this step's backward; state_dict() is that of the
    # batches taken (hybridlm/data/prefetch.py)
    batches = resources.enter_context(Prefetcher(train_batches, pin_memory=engine.device.type == "cuda"))

    def save():
        if not checkpoints:
            return
        engine.save_checkpoint(str(run.checkpoint_dir), engine.global_step,
                               {"data": batches.state_dict(), "loop": dict(state), **(client_state or {})},
                               keep_last=run.keep_last)

    bar = _progress(run.progress and main, max_steps, engine.global_step)
    say = bar.write if bar is not None else print  # a line that does not break the progress bar
    book = _StepBook(state, logger, bar, run, max_steps, on_step, say if main else None, engine.device)
    steps = _StepPipeline(engine, batches, book)

    def validation_line(step: int, val: Dict[str, float]) -> None:
        """One line per validation, the last one included, with or without the progress bar."""
        if main:
            ppl = f"  val_ppl {val['val_ppl']:.2f}" if "val_ppl" in val else ""
            say(f"step {step}: val_loss {val['val_loss']:.4f}{ppl}")

    notice = first_step_notice(engine.device) if main and engine.global_step < max_steps else None
    if notice:
        say(notice)
    val: Dict[str, float] = {}
    try:
        try:
            while engine.global_step < max_steps:
                micro = [next(batches) for _ in range(gas)]
                step = steps.launch(micro)  # (the step before is read while this one's backward runs)
                eval_due = bool(val_batches and run.eval_interval and step % run.eval_interval == 0
                                and step < max_steps)
                save_due = bool(run.save_interval and step % run.save_interval == 0 and step < max_steps)
                if eval_due or save_due or book.t_steady is None:  # these need this step's results first
                    steps.settle()
                if eval_due:
                    val = evaluate(engine, val_batches, loss_is_nll)
                    logger.log(step, val)
                    validation_line(step, val)
                if save_due:  # (tokens/s counts each step's own time: evaluations and saves are not in it)
                    save()
                kill_if_requested(step)
                # the first step ends the clock's zero point, so no budget is spent by it (a time check there
                # raced the few microseconds since t_steady was set)
                book.count_launched(step)
                out_of_time, preempted = _should_stop(book.t_steady if book.steady_steps else None,
                                                      run.max_minutes)
                if out_of_time or preempted:
                    steps.settle()
                if preempted:
                    if step < max_steps:  # else the loop ends here anyway and exports as usual
                        save()
                        raise Preempted(f"stopped by {STOP.signal_name} at step {step} "
                                        f"of {max_steps}; checkpoint saved in {run.checkpoint_dir}, rerun to resume")
                elif out_of_time:
                    if main:
                        print(f"run.max_minutes={run.max_minutes} reached at step {step} of {max_steps}", flush=True)
                    break
            steps.settle()
        except NonFiniteLossError as e:  # raised where a step's skip is counted: launched or read
            if not checkpoints:
                raise
            steps.settle()
            save()
            raise NonFiniteLossError(f"{e}; stopped at step {engine.global_step}, "
                                     f"checkpoint saved in {run.checkpoint_dir}") from None
        if val_batches:
            val = evaluate(engine, val_batches, loss_is_nll)
            # resumed at the last step (e.g. after a kill in the export): its validation row is already logged
            logged = main and any(r.get("step") == engine.global_step and "val_loss" in r
                                  for r in read_jsonl(logger.path))
            if not logged:
                logger.log(engine.global_step, val)
                validation_line(engine.global_step, val)
        save()  # a signal received in the last step or the final validation: the run shell stops after the export
    finally:
        resources.close()
        if bar is not None:
            bar.close()
        logger.close()
    history = read_jsonl(logger.path) if main else []
    last = book.last
    if not last:  # resumed at max_steps: no step ran here, the last logged loss is the final one
        last = next((r for r in reversed(history) if "loss" in r), {})
    if main:
        plot_curves(history, out / "loss_curve.png", title=title or out.name)
    barrier()
    return TrainingOutcome(
        steps=engine.global_step, tokens=state["tokens"], final_loss=last.get("loss"),
        val_loss=val.get("val_loss"), val=dict(val), skipped_steps=engine.skipped_steps,
        max_loss_increase=state["max_loss_increase"], seconds=state["seconds"], history=history,
        seconds_per_step=book.seconds_per_step())
