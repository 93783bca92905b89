"""The progress line ``upcycle run`` prints before each stage: its number, the time so far and an estimate of
the training time left.

The estimate counts the training stages (ILD of both students, KD, DPO) that are not finished: their
configured ``optim.max_steps`` (less the steps a resume checkpoint already holds) times seconds per step
*measured* on finished stages (after their first step, which carries compilation and autotuning): a stage's
own kind when one ran (the second ILD from the first), otherwise the measured seconds per token scaled by the
tokens a step of that stage holds at most. Across kinds it is rough both ways: chat KD and DPO batches are padded
to their longest example (errs high), while a KD step also runs the teacher's and the student's LM heads and the
KL, which an ILD step does not (errs low: on the H200 route ILD's rate gave ~8 minutes for a KD stage that took
11). Until a training stage has finished there is nothing to measure and the line says so. Teacher loading, SMART, compose and the report are not in the estimate.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from hybridlm.engine import CheckpointError
from hybridlm.engine.checkpoint import latest_step
from upcycle.stages import STAGES


def minutes(seconds: float) -> str:
    """``42s``, ``12m``, ``1h05m``."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    m = int(round(seconds / 60))
    return f"{m}m" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def _steps_saved(output_dir: str) -> int:
    """Steps a stage's resume checkpoint holds (the step ``checkpoints/latest`` names), 0 without one."""
    try:
        return latest_step(str(Path(output_dir) / "checkpoints")) or 0
    except (CheckpointError, OSError):  # a damaged ``latest``: the stage itself says so when it resumes
        return 0


def training_plan(kind: str, configs: Dict[str, Any]) -> Dict[str, Any]:
    """What the estimate needs of one run of the training stage ``kind`` (:data:`upcycle.stages.STAGES`; its
    sections built by the stage's schema): its kind, max_steps, the tokens of a step at most (the stage's
    ``tokens_per_step``) and its output."""
    return {"kind": kind, "max_steps": configs["optim"].max_steps,
            "tokens_per_step": STAGES[kind].tokens_per_step(configs), "output_dir": configs["run"].output_dir}


class RouteProgress:
    """``plan``: the stages in order, each None (not a training stage) or a :func:`training_plan`."""

    def __init__(self, plan: Dict[str, Optional[Dict[str, Any]]], enabled: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.plan, self.names, self.enabled, self.clock = plan, list(plan), enabled, clock
        self.t0 = clock()
        self.seconds_per_step: Dict[str, float] = {}  # finished training stages, in the order they finished

    def finished(self, name: str, result: Optional[Dict[str, Any]]) -> None:
        """A training stage is done; ``result`` (its stage.json) holds its steps and training seconds."""
        steps, seconds = (result or {}).get("steps"), (result or {}).get("seconds")
        steady = (result or {}).get("seconds_per_step")  # without the first step's compile and autotune
        if self.plan.get(name) and steady:
            self.seconds_per_step[name] = float(steady)
        elif self.plan.get(name) and steps and seconds:
            self.seconds_per_step[name] = float(seconds) / float(steps)

    def _rate(self, name: str) -> Optional[float]:
        """Estimated seconds per step of a stage that has not finished, None before any measurement."""
        if not self.seconds_per_step:
            return None
        kind = self.plan[name]["kind"]
        same = [n for n in self.seconds_per_step if self.plan[n]["kind"] == kind]
        if same:
            return self.seconds_per_step[same[-1]]
        ref = list(self.seconds_per_step)[-1]
        per_token = self.seconds_per_step[ref] / self.plan[ref]["tokens_per_step"]
        return per_token * self.plan[name]["tokens_per_step"]

    def line(self, name: str) -> str:
        i = self.names.index(name)
        left = [n for n in self.names[i:] if self.plan[n] and n not in self.seconds_per_step]
        steps: List[int] = [max(self.plan[n]["max_steps"] - _steps_saved(self.plan[n]["output_dir"]), 0)
                            for n in left]
        head = f"route: stage {i + 1}/{len(self.names)} {name} (elapsed {minutes(self.clock() - self.t0)}"
        if not left:
            return f"{head}, no training left)"
        counted = "+".join(map(str, steps))
        rates = [self._rate(n) for n in left]
        if any(r is None for r in rates):
            return f"{head}, {counted} training steps left; ETA once a training stage has been measured)"
        eta = sum(r * s for r, s in zip(rates, steps))
        return f"{head}, ETA ~{minutes(eta)} for {counted} training steps left, from measured s/step)"

    def start(self, name: str) -> None:
        if self.enabled:
            print(self.line(name), flush=True)
