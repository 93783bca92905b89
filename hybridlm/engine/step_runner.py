"""The optimizer step and its skip accounting: micro-batches, backward, DeepSpeed's step, the logged results.

Skipping a step with a non-finite loss
--------------------------------------
Stepping AdamW with zeroed gradients is *not* a skip: the moments decay, ``step`` advances and
weight decay still moves the parameters.  The engine instead uses DeepSpeed's own overflow path
(``DeepSpeedZeroOptimizer.step`` / ``BF16_Optimizer.step``): when the global gradient norm is not
finite, DeepSpeed clears the gradients and returns *before* calling the wrapped optimizer, so the
fp32 master weights, the low-precision weights, the AdamW state (``exp_avg``, ``exp_avg_sq``,
``step``) are untouched, and ``DeepSpeedEngine._take_model_step`` then does not advance the LR
scheduler and counts the step in ``skipped_steps``.  DeepSpeed checks the norm in fp32 ZeRO
unconditionally and in bf16 because we set ``bf16.check_grad_overflow`` (and, with fp32 gradient
accumulation, ZeRO-1 runs ``BF16_Optimizer``, which always checks).

A non-finite loss almost always yields non-finite gradients, but not necessarily (e.g. a constant
``inf`` term), and one rank's NaN must skip the step on every rank.  So before the *last*
micro-batch's backward the engine all-reduces, in one small tensor, the sum of the micro-batch
losses, the count of non-finite losses, the token count and the metrics (all needed for logging
anyway), and multiplies that last loss by ``where(any_nonfinite, nan, 1)``.  Multiplying by 1 is
exact, so healthy steps are bitwise unchanged; when any rank saw a non-finite loss, every rank's
gradients become NaN, the all-reduced norm is NaN on every rank, and DeepSpeed skips the update
everywhere.  This decision stays on the device (no host sync); after the step the engine checks
that DeepSpeed really skipped (``skipped_steps`` advanced) and raises otherwise.

With ``optim.step_on_device`` (bf16 ZeRO-1) DeepSpeed's step is replaced by one that skips on the device too
(hybridlm/engine/deepspeed_adapter.py ``DeepSpeedAdapter.step_on_device``: fused AdamW's ``found_inf``), so that
no step waits for its backward on the host. The same state is left untouched; the engine learns of the skip when
it reads the step's results, and it reads them, at the latest, before the next step's optimizer, when it counts the
skip and advances the LR schedule only for an applied step, as above.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hybridlm.engine.checkpoint import StepCounters
from hybridlm.engine.config import OptimConfig
from hybridlm.engine.deepspeed_adapter import DeepSpeedAdapter
from hybridlm.engine.distributed import DistInfo
from hybridlm.utils.readback import Readback, Stamp
from hybridlm.utils.tensors import map_tensors

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Dict[str, Any]], Tuple[torch.Tensor, Mapping[str, Any]]]


class NonFiniteLossError(RuntimeError):
    """Too many consecutive optimizer steps were skipped for a non-finite loss or gradient norm."""


@dataclass
class StepResult:
    """Outcome of one optimizer step (one global batch)."""

    step: int  # optimizer steps attempted so far, this one included (skipped ones count)
    loss: float  # mean over micro-batches and ranks (nan/inf when skipped for that reason)
    grad_norm: float  # global L2 norm before clipping (inf when DeepSpeed skipped the step)
    lr: float  # learning rate used by this step
    skipped: bool
    tokens: int  # summed over micro-batches and ranks
    metrics: Dict[str, float] = field(default_factory=dict)  # loss_fn metrics, mean over micro-batches and ranks
    seconds: float = float("nan")  # the step's time on the device, from its first launch to its optimizer's end


@dataclass
class EvalResult:
    loss: float
    tokens: int
    metrics: Dict[str, float] = field(default_factory=dict)
    weight: Optional[float] = None  # the loss's own "eval_weight" (e.g. DPO's pairs); None: weigh by tokens


class PendingStep:
    """A launched optimizer step (:meth:`Engine.launch_step`): ``step`` and ``lr`` are known at once, ``skipped``
    too unless the step ran on the device (``optim.step_on_device``: None until read); :meth:`result` reads the
    logged values, waiting only for this step's own work on the device."""

    def __init__(self, step: int, lr: float, skipped: Optional[bool], keys: List[str], denom: int,
                 values: Readback, is_main: bool, account: Callable[["PendingStep"], None], span: Tuple[Stamp, Stamp]):
        self.step, self.lr, self._span = step, lr, span
        self.skipped = skipped  # None: decided on the device, known once read (the values' last entry)
        self._device_skip = skipped is None
        self._keys, self._denom, self._values, self._is_main = keys, denom, values, is_main
        self._account = account
        self.streak = 0          # consecutive skipped steps up to this one (set by the step runner)
        self.skipped_total = 0   # skipped steps up to this one
        self._result: Optional[StepResult] = None

    def result(self) -> StepResult:
        if self._result is not None:
            return self._result
        host = self._values.tolist()
        if self._device_skip:
            host, found_inf = host[:-1], host[-1]
            if self.skipped is None:
                self.skipped = found_inf > 0
                self._account(self)  # may raise NonFiniteLossError, after which result() reads again
        if host[1] > 0 and not self.skipped:
            raise RuntimeError(
                "internal error: a micro-batch loss was non-finite but DeepSpeed applied the update; "
                "the NaN-skip relies on DeepSpeed's overflow check (bf16.check_grad_overflow / fp32 norm check)"
            )
        d = self._denom
        self._result = StepResult(
            step=self.step, loss=host[0] / d, grad_norm=float(host[-1]), lr=self.lr, skipped=self.skipped,
            tokens=int(round(host[2])), metrics={key: host[3 + j] / d for j, key in enumerate(self._keys)},
            seconds=self._span[1].seconds_since(self._span[0]))
        if self.skipped and self._is_main:
            logger.warning("step %d skipped: loss=%s grad_norm=%s (%d consecutive, %d total)", self.step,
                           self._result.loss, self._result.grad_norm, self.streak, self.skipped_total)
        return self._result


def _to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=device.type == "cuda"), obj)


def _scalar(v: Any, device: torch.device) -> torch.Tensor:
    """A float64 0-d tensor on ``device``; python numbers go in as a fill kernel's argument
    (``torch.full``), not a host-to-device copy, so nothing here waits for the GPU."""
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.full((), float(v), dtype=torch.float64, device=device)


def _tokens_of(batch: Any) -> int:
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0


class StepRunner:
    """Runs optimizer steps and evaluation batches on a DeepSpeed engine, and counts steps attempted, skipped
    and skipped in a row (:class:`StepCounters`)."""

    def __init__(self, deepspeed: DeepSpeedAdapter, config: OptimConfig, dist_info: DistInfo,
                 first_group_lr: Optional[float] = None) -> None:
        self.deepspeed = deepspeed
        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        # the first param group may train at its own peak lr (optim.group_lr): the reported lr is optim.lr's
        self.lr_scale = config.lr / first_group_lr if first_group_lr else 1.0
        self.gradient_accumulation_steps = config.gradient_accumulation_steps(dist_info.world_size)
        self.global_step = 0  # optimizer steps attempted (applied + skipped)
        self.skipped_steps = 0
        self.consecutive_nonfinite = 0
        self.unread: Optional[PendingStep] = None  # step_on_device: the last step, its skip not read yet

    @property
    def lr(self) -> float:
        """Learning rate the next step will use at ``optim.lr`` (a named group's rate is this scaled to its own)."""
        return self.deepspeed.lr * self.lr_scale

    def counters(self) -> StepCounters:
        return StepCounters(self.global_step, self.skipped_steps, self.consecutive_nonfinite)

    def restore(self, counters: StepCounters) -> None:
        self.global_step = int(counters.global_step)
        self.skipped_steps = int(counters.skipped_steps)
        self.consecutive_nonfinite = int(counters.consecutive_nonfinite)

    def settle(self) -> None:
        """Read the last step's skip if it is not read yet (``optim.step_on_device``)."""
        if self.unread is not None:
            self.unread.result()

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.dist.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def launch(self, loss_fn: LossFn, micro_batches: Sequence[Mapping[str, Any]],
               before_optimizer_step: Optional[Callable[[], None]] = None) -> PendingStep:
        """One optimizer step over this rank's micro-batches (:meth:`hybridlm.engine.Engine.launch_step`)."""
        n = len(micro_batches)
        if n != self.gradient_accumulation_steps:
            raise ValueError(
                f"train_step: got {n} micro-batches, expected gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} (global_batch_size / (micro_batch_size x world size))"
            )
        deepspeed = self.deepspeed
        deepspeed.ensure_training()
        dev = self.device
        start = Stamp(dev)
        skipped_before = deepspeed.skipped_steps

        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        bad = torch.zeros((), dtype=torch.float64, device=dev)
        tokens = torch.zeros((), dtype=torch.float64, device=dev)
        metric_sums: Dict[str, torch.Tensor] = {}
        keys: Optional[List[str]] = None
        stats: Optional[torch.Tensor] = None

        for i, mb in enumerate(micro_batches):
            mb = _to_device(mb, dev)
            loss, metrics = loss_fn(deepspeed.model, mb)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError("loss_fn must return (scalar loss tensor, metrics dict)")
            if not loss.requires_grad:
                raise RuntimeError("loss_fn returned a loss that does not depend on any trainable parameter")
            loss = loss.reshape(())
            metrics = dict(metrics or {})
            n_tok = metrics.pop("tokens", None)
            tokens += _scalar(n_tok if n_tok is not None else _tokens_of(mb), dev)
            if keys is None:
                keys = sorted(metrics)
                metric_sums = {k: torch.zeros((), dtype=torch.float64, device=dev) for k in keys}
            elif sorted(metrics) != keys:
                raise ValueError(f"loss_fn returned metric keys {sorted(metrics)}, earlier {keys}")
            for k in keys:
                metric_sums[k] += _scalar(metrics[k], dev)
            ld = loss.detach().to(torch.float64)
            loss_sum += ld
            bad += (~torch.isfinite(ld)).to(torch.float64)

            if i == n - 1:
                # One collective carries everything logged and the skip decision (module docstring).
                stats = self._reduce(torch.stack([loss_sum, bad, tokens] + [metric_sums[k] for k in keys]))
                poison = torch.where(stats[1] > 0, float("nan"), 1.0).to(dtype=loss.dtype)
                loss = loss * poison
            deepspeed.backward(loss)
            if i == n - 1:
                if before_optimizer_step is not None:
                    before_optimizer_step()
                self.settle()  # the last step's skip decides the schedule this step runs with
                lr = self.lr
            deepspeed.step()

        assert stats is not None and keys is not None
        norm = deepspeed.grad_norm()
        tail = [_scalar(norm if norm is not None else float("nan"), dev).reshape(1)]
        if self.config.step_on_device:  # whether the step was skipped is known on the device only
            tail.append(deepspeed.found_inf().to(torch.float64).reshape(1))
        self.global_step += 1
        end = Stamp(dev)  # before the Readback, so that reading it means the stamp's work is done
        pending = PendingStep(step=self.global_step, lr=lr,
                              skipped=None if self.config.step_on_device else deepspeed.skipped_steps > skipped_before,
                              keys=keys, denom=n * self.dist.world_size,
                              values=Readback(torch.cat([stats] + tail)), is_main=self.dist.is_main,
                              account=self.account, span=(start, end))
        if self.config.step_on_device:
            self.unread = pending
        else:
            self.account(pending)
        return pending

    def account(self, pending: PendingStep) -> None:
        """Count a step skipped or applied, once it is known whether it was (with the step on the device: when
        its results are read); an applied step on the device advances the LR schedule then."""
        if pending is self.unread:
            self.unread = None
        if pending.skipped:
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
        else:
            self.consecutive_nonfinite = 0
            if self.config.step_on_device:
                self.deepspeed.advance_schedule()
        pending.streak, pending.skipped_total = self.consecutive_nonfinite, self.skipped_steps
        if pending.skipped and self.consecutive_nonfinite >= self.config.max_consecutive_nonfinite:
            result = pending.result()
            raise NonFiniteLossError(
                f"{self.consecutive_nonfinite} consecutive optimizer steps skipped for a non-finite loss or "
                f"gradient norm (optim.max_consecutive_nonfinite={self.config.max_consecutive_nonfinite}); "
                f"last: step {pending.step}, loss={result.loss}, grad_norm={result.grad_norm}"
            )

    @torch.no_grad()
    def evaluate(self, loss_fn: LossFn, batch: Mapping[str, Any]) -> EvalResult:
        """Loss and metrics of one batch on this rank, in eval mode, without gradients."""
        with self.deepspeed.evaluating() as model:
            batch = _to_device(batch, self.device)
            loss, metrics = loss_fn(model, batch)
        metrics = dict(metrics or {})
        n_tok = metrics.pop("tokens", None)
        weight = metrics.pop("eval_weight", None)
        keys = sorted(metrics)
        vals = torch.stack(
            [_scalar(loss, self.device), _scalar(n_tok if n_tok is not None else _tokens_of(batch), self.device),
             _scalar(weight if weight is not None else 0, self.device)]
            + [_scalar(metrics[k], self.device) for k in keys]
        ).tolist()
        return EvalResult(loss=vals[0], tokens=int(round(vals[1])), weight=vals[2] if weight is not None else None,
                          metrics={k: vals[3 + j] for j, k in enumerate(keys)})
