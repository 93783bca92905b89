"""The one training engine: DeepSpeed ZeRO-1 (or 2), AdamW, warmup+cosine, clipping, NaN skipping.

Every stage (pre-training, layer distillation, KD, DPO) builds an :class:`Engine` around the
model it trains and a ``loss_fn(model, batch) -> (loss, metrics)``.  A KD stage's ``loss_fn``
closes over a frozen teacher, DPO's over a frozen reference model; only the parameters of the
model handed to the engine (optionally only ``trainable``) are optimised.

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
(hybridlm/engine/device_step.py: fused AdamW's ``found_inf``), so that no step waits for its backward on the
host. The same state is left untouched; the engine learns of the skip when it reads the step's results, and it
reads them, at the latest, before the next step's optimizer, when it counts the skip and advances the LR
schedule only for an applied step, as above.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hybridlm.config.errors import ConfigError
from hybridlm.engine import checkpoint as ckpt
from hybridlm.engine.checkpoint import CheckpointError
from hybridlm.engine.clipping import clip_before_step, norm_over_flat_gradients
from hybridlm.engine.device_step import ScheduleAdvancedByEngine, step_on_device
from hybridlm.engine.config import OptimConfig
from hybridlm.engine.distributed import DistInfo, barrier, init_distributed
from hybridlm.engine.schedule import lr_lambda_from_config
from hybridlm.utils.atomic import TMP_PREFIX, atomic_write_text, disk_full_error, fsync_dir, fsync_tree
from hybridlm.utils.faults import disk_full_in, kill_in
from hybridlm.utils.readback import Readback, Stamp
from hybridlm.utils.tensors import map_tensors

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Dict[str, Any]], Tuple[torch.Tensor, Mapping[str, Any]]]

_ENGINE_STATE_KEY = "hybridlm_engine"
_CLIENT_STATE_KEY = "client_state"


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
        self.streak = 0          # consecutive skipped steps up to this one (set by the engine)
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


# ------------------------------------------------------------------------------ parameter groups


def no_weight_decay(param: nn.Parameter) -> bool:
    """1-D parameters (norm weights, biases, scalars) and any tagged ``_no_weight_decay`` are not decayed."""
    return param.ndim < 2 or bool(getattr(param, "_no_weight_decay", False))


def build_param_groups(
    model: nn.Module, weight_decay: float, trainable: Optional[Iterable[nn.Parameter]] = None
) -> List[Dict[str, Any]]:
    """AdamW param groups ``[decay, no_decay]`` of the parameters that require grad (or ``trainable``)."""
    if trainable is None:
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        params = list(trainable)
    seen = set()
    decay, no_decay = [], []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if no_weight_decay(p) else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


# ------------------------------------------------------------------------------------- utilities


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


def clips_in_engine(cfg: OptimConfig) -> bool:
    """Whether the engine clips the gradients itself: where DeepSpeed runs its ``BF16_Optimizer`` (bf16 weights,
    fp32 gradient accumulation, ZeRO-1), whose clipping loop the GPU waits for (hybridlm/engine/clipping.py)."""
    return cfg.precision == "bf16" and cfg.zero_stage == 1 and cfg.grad_clip > 0


def deepspeed_config(cfg: OptimConfig, world_size: int) -> Dict[str, Any]:
    """The DeepSpeed config dict the engine runs with (no optimizer/scheduler: both are passed in)."""
    gas = cfg.gradient_accumulation_steps(world_size)
    bf16 = cfg.precision == "bf16"
    ds: Dict[str, Any] = {
        "train_batch_size": cfg.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": gas,
        # bf16 + ZeRO-1 clips in the engine (hybridlm/engine/clipping.py): DeepSpeed's loop there stalls the GPU
        "gradient_clipping": 0.0 if clips_in_engine(cfg) else float(cfg.grad_clip),
        "zero_optimization": {"stage": cfg.zero_stage},
        # check_grad_overflow: a non-finite gradient norm skips the update (see module docstring).
        "bf16": {"enabled": bf16, "check_grad_overflow": True, "immediate_grad_update": cfg.immediate_grad_update},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the device when each forward starts and each
        # step ends: the GPU then waits for the host to launch the next step (the loop measures tokens/s itself)
        "timers": {"throughput": {"enabled": False}},
    }
    if bf16:
        # bf16 weights/activations, fp32 master weights, fp32 gradient accumulation.
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if cfg.precision == "bf16-mixed":
        # fp32 weights; DeepSpeed runs the forward under torch.autocast(bf16) (engine(...) and eval alike)
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return ds


def _safe_checkpoint_engine(base):
    """DeepSpeed's torch checkpoint engine with ``load`` through :func:`hybridlm.engine.checkpoint.safe_load`
    (saving unchanged). Every DeepSpeed read of a checkpoint (model states, ZeRO optimizer shards) goes
    through its checkpoint engine's ``load``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(base) is not TorchCheckpointEngine:
        raise ConfigError(f"Engine: DeepSpeed chose the checkpoint engine {type(base).__name__}; only the torch "
                          "checkpoint engine is supported (its loads are made safe)")

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return ckpt.safe_load(path, map_location=map_location)

    safe = SafeTorchCheckpointEngine.__new__(SafeTorchCheckpointEngine)
    safe.__dict__.update(base.__dict__)  # the same settings (serialization format, name)
    return safe


_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) "
                            r"from checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
_KEY_MISMATCH = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: \"([^\"]+)\"")


def _state_dict_mismatch(message: str) -> Optional[str]:
    """The first tensor that torch's ``load_state_dict`` error names (a shape or a key the model and the
    checkpoint disagree on), as a phrase; None for any other error."""
    m = _SIZE_MISMATCH.search(message)
    if m:
        return f"tensor {m.group(1)} has shape {m.group(2)} in the checkpoint, {m.group(3)} in this model"
    m = _KEY_MISMATCH.search(message)
    if m:
        where = "this model has no" if m.group(1) == "Unexpected" else "the checkpoint has no"
        return f"{where} tensor {m.group(2)}"
    return None


# ---------------------------------------------------------------------------------------- engine


class Engine:
    """DeepSpeed-backed trainer core shared by every stage.

    Args:
        model: the module to train (moved to this rank's device; cast to bf16 when
            ``precision == "bf16"``, kept in fp32 under autocast when ``"bf16-mixed"``).  Parameters with ``requires_grad=False`` stay frozen.
        config: an :class:`OptimConfig`.
        loss_fn: ``loss_fn(model, batch) -> (loss, metrics)``; ``model`` is the DeepSpeed engine
            (calling it runs ``module.forward``; attribute access falls through to the module).
            ``loss`` is a scalar tensor; ``metrics`` maps names to scalars (tensors or numbers) and
            must have the same keys on every call; an optional ``"tokens"`` entry is summed into
            :attr:`StepResult.tokens` instead (default: ``batch["input_ids"].numel()``).
        trainable: optional subset of ``model``'s parameters to train; every other parameter of
            ``model`` is frozen (``requires_grad_(False)``).
        ds_overrides: extra keys merged into the DeepSpeed config (advanced use).

    Constructing an engine seeds python/numpy/torch RNGs with ``config.seed + rank``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: OptimConfig,
        loss_fn: LossFn,
        *,
        trainable: Optional[Iterable[nn.Parameter]] = None,
        ds_overrides: Optional[Mapping[str, Any]] = None,
    ) -> None:
        config.validate("optim")
        self.config = config
        self.loss_fn = loss_fn
        self.dist: DistInfo = init_distributed()
        self.gradient_accumulation_steps = config.gradient_accumulation_steps(self.dist.world_size)

        if trainable is not None:
            trainable = list(trainable)
            ids = {id(p) for p in trainable}
            model_ids = {id(p) for p in model.parameters()}
            if not ids <= model_ids:
                raise ValueError("Engine: every parameter in `trainable` must belong to `model`")
            for p in model.parameters():
                p.requires_grad_(id(p) in ids)
            for p in trainable:
                p.requires_grad_(True)
        groups = build_param_groups(model, config.weight_decay, trainable)
        if not groups:
            raise ValueError("Engine: the model has no trainable parameters")

        if config.activation_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ConfigError(f"optim.activation_checkpointing: {type(model).__name__} does not support it")
            # transformers 5.24 names it activation_checkpointing_enable and warns on the old name
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ckpt.seed_everything(config.seed + self.dist.rank)
        model.to(self.dist.device)
        optimizer = torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=tuple(config.betas),
            eps=config.eps,
            weight_decay=config.weight_decay,
            # fused on a GPU; and wherever the step runs on the device, which skips through fused AdamW's found_inf
            fused=self.dist.device.type == "cuda" or config.step_on_device,
        )
        factor = lr_lambda_from_config(config)

        ds_config = deepspeed_config(config, self.dist.world_size)
        if ds_overrides:
            ds_config.update(dict(ds_overrides))

        import deepspeed

        self.ds_engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: (ScheduleAdvancedByEngine(opt, factor) if config.step_on_device
                                      else torch.optim.lr_scheduler.LambdaLR(opt, factor)),
            config=ds_config,
            dist_init_required=False,
        )
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        bf16_optimizer = isinstance(self.optimizer, BF16_Optimizer)
        if (clips_in_engine(config) or config.step_on_device) and not bf16_optimizer:
            raise RuntimeError(f"Engine: expected DeepSpeed's BF16_Optimizer for bf16 ZeRO-1, got "
                               f"{type(self.optimizer).__name__}; the engine's clipping and step assume it")
        if config.step_on_device:  # it clips too (hybridlm/engine/device_step.py)
            step_on_device(self.optimizer, config.grad_clip)
        elif clips_in_engine(config) and ds_config.get("gradient_clipping") == 0.0:  # not overridden
            # DeepSpeed's norm, taken just before it steps the optimizer (hybridlm/engine/clipping.py)
            clip_before_step(self.ds_engine.basic_optimizer, config.grad_clip,
                             norm=lambda: self.optimizer._global_grad_norm)
        if bf16_optimizer and not config.step_on_device:  # (the device step takes its own norm over the same buffers)
            norm_over_flat_gradients(self.optimizer)
        if bf16_optimizer and self.dist.world_size == 1:
            # One rank: DeepSpeed's all-reduce of the fp32 gradient sums is a flatten into its bf16 communication
            # dtype, a reduce over one rank and a copy back (1 ms a GDN-300M step on an H200); it would also round
            # sums accumulated over micro-batches to bf16. Several ranks communicate in bf16 (DeepSpeed's
            # communication_data_type).
            self.ds_engine.enable_backward_allreduce = False
        # DeepSpeed's own loader unpickles with weights_only=False: ours reads tensors and plain data only
        self.ds_engine.checkpoint_engine = _safe_checkpoint_engine(self.ds_engine.checkpoint_engine)
        self.module: nn.Module = self.ds_engine.module
        self.device = self.dist.device
        self.global_step = 0  # optimizer steps attempted (applied + skipped)
        self.skipped_steps = 0
        self.consecutive_nonfinite = 0
        self._unread: Optional[PendingStep] = None  # step_on_device: the last step, its skip not read yet
        self._group_decay = [g["weight_decay"] for g in groups]  # each param group's weight decay
        self.resume_note: Optional[str] = None  # set by load_checkpoint when a setting changed since the save

    # ------------------------------------------------------------------------------ properties

    @property
    def model(self) -> nn.Module:
        """The DeepSpeed engine: what ``loss_fn`` receives."""
        return self.ds_engine

    @property
    def lr(self) -> float:
        """Learning rate the next step will use."""
        return float(self.ds_engine.basic_optimizer.param_groups[0]["lr"])

    @property
    def applied_steps(self) -> int:
        return self.global_step - self.skipped_steps

    # ------------------------------------------------------------------------------ training

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.dist.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def train_step(self, micro_batches: Sequence[Mapping[str, Any]],
                   before_optimizer_step: Optional[Callable[[], None]] = None) -> StepResult:
        """One optimizer step over this rank's ``gradient_accumulation_steps`` micro-batches, its results read
        at once (:meth:`launch_step` launches it without waiting for them)."""
        return self.launch_step(micro_batches, before_optimizer_step).result()

    def launch_step(self, micro_batches: Sequence[Mapping[str, Any]],
                    before_optimizer_step: Optional[Callable[[], None]] = None) -> "PendingStep":
        """Launch one optimizer step over this rank's ``gradient_accumulation_steps`` micro-batches; what it
        logs (loss, tokens, metrics, gradient norm) is read when ``result()`` is called on what this returns.

        With DeepSpeed's step, whether the step was skipped is known at once (DeepSpeed decides it on the host),
        so the skip accounting and :class:`NonFiniteLossError` happen here; with ``optim.step_on_device`` they
        happen when the step is read, at the latest in the next launch, before its optimizer step. A loop that
        reads step ``k``'s result after launching step ``k + 1`` keeps the GPU fed while the host logs
        (hybridlm/utils/readback.py).

        ``before_optimizer_step()``, if given, runs once the last backward is launched, just before the optimizer
        step, whose gradient-norm check then waits for the GPU: host work placed there (the next batch,
        hybridlm/data/prefetch.py) overlaps the backward instead of delaying the next forward."""
        n = len(micro_batches)
        if n != self.gradient_accumulation_steps:
            raise ValueError(
                f"train_step: got {n} micro-batches, expected gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} (global_batch_size / (micro_batch_size x world size))"
            )
        engine = self.ds_engine
        # train() walks every module (4.7-5.6 ms in traced GDN-300M steps): only on a change of the inner module's
        # mode (DeepSpeedEngine.eval() leaves its own flag set)
        if not self.module.training:
            engine.train()
        dev = self.device
        start = Stamp(dev)
        skipped_before = engine.skipped_steps

        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        bad = torch.zeros((), dtype=torch.float64, device=dev)
        tokens = torch.zeros((), dtype=torch.float64, device=dev)
        metric_sums: Dict[str, torch.Tensor] = {}
        keys: Optional[List[str]] = None
        stats: Optional[torch.Tensor] = None

        for i, mb in enumerate(micro_batches):
            mb = _to_device(mb, dev)
            loss, metrics = self.loss_fn(engine, mb)
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
            engine.backward(loss)
            if i == n - 1:
                if before_optimizer_step is not None:
                    before_optimizer_step()
                if self._unread is not None:  # its skip decides the schedule this step runs with
                    self._unread.result()
                lr = self.lr
            engine.step()

        assert stats is not None and keys is not None
        norm = engine.get_global_grad_norm()
        tail = [_scalar(norm if norm is not None else float("nan"), dev).reshape(1)]
        if self.config.step_on_device:  # whether the step was skipped is known on the device only
            tail.append(self.optimizer.found_inf.to(torch.float64).reshape(1))
        self.global_step += 1
        end = Stamp(dev)  # before the Readback, so that reading it means the stamp's work is done
        pending = PendingStep(step=self.global_step, lr=lr,
                              skipped=None if self.config.step_on_device else engine.skipped_steps > skipped_before,
                              keys=keys, denom=n * self.dist.world_size,
                              values=Readback(torch.cat([stats] + tail)), is_main=self.dist.is_main,
                              account=self._account, span=(start, end))
        if self.config.step_on_device:
            self._unread = pending
        else:
            self._account(pending)
        return pending

    def _account(self, pending: "PendingStep") -> None:
        """Count a step skipped or applied, once it is known whether it was (with the step on the device: when
        its results are read); an applied step on the device advances the LR schedule then."""
        if pending is self._unread:
            self._unread = None
        if pending.skipped:
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
        else:
            self.consecutive_nonfinite = 0
            if self.config.step_on_device:
                self.lr_scheduler.advance()
        pending.streak, pending.skipped_total = self.consecutive_nonfinite, self.skipped_steps
        if pending.skipped and self.consecutive_nonfinite >= self.config.max_consecutive_nonfinite:
            result = pending.result()
            raise NonFiniteLossError(
                f"{self.consecutive_nonfinite} consecutive optimizer steps skipped for a non-finite loss or "
                f"gradient norm (optim.max_consecutive_nonfinite={self.config.max_consecutive_nonfinite}); "
                f"last: step {pending.step}, loss={result.loss}, grad_norm={result.grad_norm}"
            )

    @torch.no_grad()
    def eval_step(self, batch: Mapping[str, Any]) -> EvalResult:
        """Loss and metrics of one batch on this rank, in eval mode, without gradients."""
        engine = self.ds_engine
        was_training = engine.training
        engine.eval()
        try:
            batch = _to_device(batch, self.device)
            loss, metrics = self.loss_fn(engine, batch)
        finally:
            engine.train(was_training)
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

    # ------------------------------------------------------------------------------ checkpoints

    def _engine_state(self) -> Dict[str, Any]:
        return {
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "world_size": self.dist.world_size,
            "optim": dataclasses.asdict(self.config),
        }

    def save_checkpoint(
        self, save_dir: str, step: int, client_state: Optional[Mapping[str, Any]] = None, *, keep_last: Optional[int] = None
    ) -> str:
        """Atomically save model, optimizer, scheduler, RNG and counters as ``<save_dir>/step_<step>``.

        Collective: every rank must call it.  The checkpoint is written into ``.tmp_step_<step>``,
        fsynced, its files' sizes and sha256 recorded in its manifest, renamed to ``step_<step>`` (or, when that
        exists, a fresh ``step_<step>.<k>``), and only then ``latest`` is replaced (write-temp + ``os.replace``)
        and an earlier save of the same step deleted; a crash at any point leaves ``latest`` naming a complete
        checkpoint.  ``keep_last`` (if set) prunes all but the newest ``keep_last`` checkpoints. A full disk
        removes the partial ``.tmp_step_<step>`` and raises :class:`~hybridlm.utils.atomic.DiskFullError`.
        ``client_state`` must be tensors and plain data (dicts, lists, numbers, strings): every file of a
        checkpoint is read back with ``weights_only=True``. It is returned by :meth:`load_checkpoint`.
        Returns the path of the new checkpoint.
        """
        if self._unread is not None:  # the counters and the schedule saved must include the last step's skip
            self._unread.result()
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last: expected a positive integer, got {keep_last!r}")
        save_dir = os.path.abspath(os.fspath(save_dir))
        tmp_tag = TMP_PREFIX + ckpt.step_tag(step)
        tmp_dir = os.path.join(save_dir, tmp_tag)
        rank = self.dist.rank

        if rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            ckpt.remove_stale_temporaries(save_dir)
        barrier()
        # a step saved again (after a resume, or a pre-emption during its save) goes into a fresh directory:
        # the earlier one stays loadable, and named by `latest`, until the new one is committed
        tag = ckpt.free_tag(save_dir, step)
        final_dir = os.path.join(save_dir, tag)

        state = {
            _ENGINE_STATE_KEY: self._engine_state(),
            _CLIENT_STATE_KEY: dict(client_state) if client_state is not None else {},
        }
        try:
            self.ds_engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=state, save_latest=False)
            rng_path = os.path.join(tmp_dir, ckpt.rng_file(rank))
            torch.save(ckpt.get_rng_state(), rng_path)
            disk_full_in("save", step)
            kill_in("save", step)  # reliability drills: a kill with the files written, nothing committed
            barrier()
            if self.dist.local_rank == 0:  # one process per node: covers node-local and shared filesystems
                fsync_tree(tmp_dir)
            barrier()
            if rank == 0:
                ckpt.write_manifest(tmp_dir, {"step": int(step), "world_size": self.dist.world_size, "tag": tag,
                                              "precision": self.config.precision})
                fsync_dir(tmp_dir)
        except Exception as e:
            full = disk_full_error(e, tmp_dir, f"the checkpoint save of step {step}")
            if full is None:
                raise
            if rank == 0:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise full from None

        if rank == 0:
            os.rename(tmp_dir, final_dir)  # a name not in use: nothing that `latest` names is touched
            fsync_dir(save_dir)
            kill_in("save-committed", step)
            atomic_write_text(os.path.join(save_dir, ckpt.LATEST), tag + "\n")  # the commit point
            kill_in("save-latest", step)
            ckpt.remove_superseded(save_dir, tag)
            if keep_last is not None:
                ckpt.prune(save_dir, keep_last, protect=tag)
        barrier()
        return final_dir

    def _resolve_checkpoint(self, path: str, required: bool) -> Optional[Tuple[str, str]]:
        """``(save_dir, tag)`` to load from ``path`` (a save dir or a ``step_<N>`` dir), or None."""
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {path}: does not exist")
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path}: is not a directory")
        if os.path.isfile(os.path.join(path, ckpt.MANIFEST)) or os.path.isfile(
            os.path.join(path, "mp_rank_00_model_states.pt")
        ):
            parent, tag = os.path.split(path)
            return parent, tag
        tag = ckpt.read_latest(path)
        if tag is None:
            # a save killed between its rename and the first `latest`: a step directory is complete once renamed
            # (its manifest is written before), so the newest one is where the run stands
            complete = [p for _step, p in ckpt.list_step_dirs(path)
                        if os.path.isfile(os.path.join(p, ckpt.MANIFEST))]
            if complete:
                return path, os.path.basename(complete[-1])
            if required or ckpt.list_step_dirs(path):
                raise CheckpointError(f"checkpoint {path}: no '{ckpt.LATEST}' file naming a complete checkpoint")
            return None
        tag_dir = os.path.join(path, tag)
        if not os.path.isdir(tag_dir):
            raise CheckpointError(f"checkpoint {path}: '{ckpt.LATEST}' names {tag!r}, which does not exist")
        return path, tag

    def _load_resharded_optimizer(self, tag_dir: str, saved_world_size: int) -> None:
        """The fp32 master weights and AdamW moments of a checkpoint saved on ``saved_world_size`` ranks, put into
        this engine's ZeRO partition on the current number of ranks.

        Every saved shard records which slice of which parameter it holds (``param_slice_mappings``: name ->
        start and length in that rank's flat partition); the shards of all ranks, read in rank order, give each
        parameter's full fp32 value and moments. Each current rank then copies the slice of every parameter that
        its own partition holds (DeepSpeed's ``_hp_mapping`` of each parameter: where the slice starts in the
        parameter and in the partition). Values are copied, not recomputed, so the state is exact; the step
        count is the saved one.
        """
        pattern = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
        shards = {int(m.group(1)): os.path.join(tag_dir, f) for f in os.listdir(tag_dir) if (m := pattern.match(f))}
        if sorted(shards) != list(range(saved_world_size)):
            raise CheckpointError(f"checkpoint {tag_dir}: expected the optimizer shards of ranks 0..{saved_world_size - 1}, "
                                  f"found {sorted(shards)}")
        pieces: Dict[str, Dict[str, List[torch.Tensor]]] = {}
        steps = set()
        for r in range(saved_world_size):
            sd = ckpt.safe_load(shards[r])["optimizer_state_dict"]
            states = sd["base_optimizer_state"]["state"]
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                flat, state = sd["single_partition_of_fp32_groups"][g], states[g]
                steps.add(float(state["step"]))
                for name, addr in mapping.items():
                    slot = pieces.setdefault(name, {"fp32": [], "exp_avg": [], "exp_avg_sq": []})
                    slot["fp32"].append(flat.narrow(0, addr.start, addr.numel))
                    for key in ("exp_avg", "exp_avg_sq"):
                        slot[key].append(state[key].narrow(0, addr.start, addr.numel))
        if len(steps) != 1:
            raise CheckpointError(f"checkpoint {tag_dir}: the shards disagree on the optimizer step ({sorted(steps)})")
        full = {name: {k: torch.cat(v) for k, v in slot.items()} for name, slot in pieces.items()}
        step = steps.pop()

        base = self.ds_engine.optimizer.optimizer  # the torch AdamW stepping the flat fp32 partitions
        for group in base.param_groups:  # AdamW creates its state at the first step: create it now
            flat = group["params"][0]
            on_device = group.get("fused") or group.get("capturable")
            base.state[flat] = {"step": torch.tensor(step, dtype=torch.float32,
                                                     device=flat.device if on_device else "cpu"),
                                "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
        for name, param in self.ds_engine.module.named_parameters():
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:  # no slice of it in this rank's partition
                continue
            if name not in full or full[name]["fp32"].numel() != param.numel():
                raise CheckpointError(f"checkpoint {tag_dir}: optimizer state of {name} missing or of another size")
            lo, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            at = mapping.hp_fragment_address.start
            group = base.param_groups[mapping.param_group_index]
            flat = group["params"][0]
            flat.data.narrow(0, at, n).copy_(full[name]["fp32"][lo:lo + n])
            for key in ("exp_avg", "exp_avg_sq"):
                base.state[flat][key].narrow(0, at, n).copy_(full[name][key][lo:lo + n])
        # the learning rate lives in the optimizer's groups, which a full optimizer load would restore
        for group, lr in zip(base.param_groups, self.ds_engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
        self.ds_engine.optimizer._link_all_hp_params()  # the per-parameter views of the new state

    def load_checkpoint(self, path: str, *, required: bool = False) -> Optional[Dict[str, Any]]:
        """Restore model, optimizer, scheduler, RNG and counters; return the saved ``client_state``.

        ``path`` is a save directory (the checkpoint named by its ``latest`` file is loaded) or one
        ``step_<N>`` directory. It may have been saved on another number of ranks
        (:meth:`_load_resharded_optimizer`).  Returns None when ``path`` is a directory holding no checkpoint yet
        (unless ``required``).  A missing path, a dangling ``latest``, an incomplete or unreadable
        checkpoint raise :class:`CheckpointError` (a ``ConfigError``) naming the path.  Collective.
        """
        path = os.path.abspath(os.fspath(path))
        resolved = self._resolve_checkpoint(path, required)
        if resolved is None:
            return None
        save_dir, tag = resolved
        tag_dir = os.path.join(save_dir, tag)
        manifest = ckpt.read_manifest(tag_dir)
        self._check_precision(tag_dir, manifest)
        saved_ws = manifest.get("world_size")
        if isinstance(saved_ws, bool) or not isinstance(saved_ws, int) or saved_ws < 1:
            raise CheckpointError(f"checkpoint {tag_dir}: manifest has no valid world_size ({saved_ws!r})")
        resharded = saved_ws != self.dist.world_size
        # a rank that did not exist at the save starts from rank 0's generators
        rng_rank = self.dist.rank if self.dist.rank < saved_ws else 0
        rng_path = os.path.join(tag_dir, ckpt.rng_file(rng_rank))
        try:
            # another number of ranks: DeepSpeed loads the model and the schedule, the optimizer state is
            # re-partitioned from every saved shard below (the docstring of _load_resharded_optimizer)
            load_path, state = self.ds_engine.load_checkpoint(
                save_dir, tag=tag, load_optimizer_states=not resharded, load_lr_scheduler_states=True
            )
            if resharded and load_path is not None:
                self._load_resharded_optimizer(tag_dir, saved_ws)
            rng = ckpt.safe_load(rng_path)
        except CheckpointError:
            raise
        except Exception as e:  # torch/pickle/DeepSpeed errors on a damaged checkpoint
            mismatch = _state_dict_mismatch(str(e))
            if mismatch:
                raise CheckpointError(f"checkpoint {tag_dir}: {mismatch}; the model settings changed since the save "
                                      f"(resume with the settings it was saved with, or start a new "
                                      f"run.output_dir)") from None
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointError(f"checkpoint {tag_dir}: could not be loaded ({type(e).__name__}: {msg})") from e
        if load_path is None or state is None or _ENGINE_STATE_KEY not in state:
            raise CheckpointError(f"checkpoint {tag_dir}: not a checkpoint written by hybridlm.engine")
        es = state[_ENGINE_STATE_KEY]
        self.global_step = int(es["global_step"])
        self.skipped_steps = int(es["skipped_steps"])
        self.consecutive_nonfinite = int(es["consecutive_nonfinite"])
        ckpt.set_rng_state(rng)
        self.resume_note = self._apply_settings(es.get("optim") or {})
        barrier()
        return state.get(_CLIENT_STATE_KEY, {})

    def _check_precision(self, tag_dir: str, manifest: Mapping[str, Any]) -> None:
        """Refuse, naming the setting, a checkpoint saved with another ``optim.precision`` (its optimizer files
        are another kind: bf16 runs save ``bf16_zero_pp_rank_*``)."""
        saved = manifest.get("precision")
        now = self.config.precision
        if saved is None:  # an older manifest: the kind of its optimizer files tells bf16 from the others
            names = manifest.get("files") or {}
            bf16_files = any(str(n).startswith("bf16_zero_pp_rank_") for n in names)
            if bf16_files == (now == "bf16"):
                return
            saved = "bf16" if bf16_files else "fp32 or bf16-mixed"
        if saved != now:
            raise CheckpointError(f"checkpoint {tag_dir}: saved with optim.precision={saved}, this run has "
                                  f"optim.precision={now}; resume with optim.precision={saved}, or start a new "
                                  f"run.output_dir")

    def _apply_settings(self, saved: Mapping[str, Any]) -> Optional[str]:
        """After a load: the learning rate of the next step from this run's schedule (``optim.lr``, ``min_lr``,
        ``warmup_steps``, ``max_steps``) at the number of updates applied so far, and this run's ``weight_decay``,
        ``betas`` and ``eps`` in the optimizer's groups; DeepSpeed's load put back the saved ones. The saved
        settings and the new ones are never blended: a changed setting applies from the resume step on, and
        the returned line says which changed (None when none did)."""
        cfg = self.config
        sched = self.lr_scheduler
        groups = self.ds_engine.basic_optimizer.param_groups  # the AdamW that ZeRO steps (lr is read there)
        applied = int(sched.last_epoch)
        factor = lr_lambda_from_config(cfg)
        sched.base_lrs = [cfg.lr for _ in groups]
        lrs = [cfg.lr * factor(applied) for _ in groups]
        for group, lr, decay in zip(groups, lrs, self._group_decay):
            group["lr"] = lr
            group["weight_decay"] = decay
            group["betas"] = tuple(cfg.betas)
            group["eps"] = cfg.eps
        sched._last_lr = list(lrs)
        changed = []
        for key in ("lr", "min_lr", "warmup_steps", "max_steps", "weight_decay", "betas", "eps", "grad_clip"):
            if key not in saved:
                continue
            old, new = saved[key], getattr(cfg, key)
            if isinstance(old, (list, tuple)):
                old, new = list(old), list(new)
            if old != new:
                changed.append(f"optim.{key} {old} -> {new}")
        if not changed:
            return None
        return (f"resumed with changed settings: {', '.join(changed)}; the new settings apply from step "
                f"{self.global_step + 1} on (its lr {lrs[0]:.6g}: this run's schedule at {applied} applied updates), "
                f"the steps before it kept the old ones")
