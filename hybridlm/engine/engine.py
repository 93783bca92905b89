"""The one training engine: DeepSpeed ZeRO-1 (or 2), AdamW, warmup+cosine, clipping, NaN skipping.

Every stage (pre-training, layer distillation, KD, DPO) builds an :class:`Engine` around the
model it trains and a ``loss_fn(model, batch) -> (loss, metrics)``.  A KD stage's ``loss_fn``
closes over a frozen teacher, DPO's over a frozen reference model; only the parameters of the
model handed to the engine (optionally only ``trainable``) are optimised.

The engine is a facade over three components, one job each, side by side on one
:class:`~hybridlm.engine.deepspeed_adapter.DeepSpeedAdapter` (the one module that touches DeepSpeed):

* hybridlm/engine/build.py: what trains and how the optimizer steps (param groups, AdamW, the schedule,
  clipping or the step on the device), handed to ``deepspeed.initialize``;
* hybridlm/engine/step_runner.py: the step, evaluation, and the skip accounting (its module docstring says
  how a step with a non-finite loss is skipped);
* hybridlm/engine/checkpoint_store.py: save / resolve / load, the precision check and the settings changed on
  resume (the ZeRO-1 resharding is the adapter's).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence

from torch import nn

from hybridlm.engine.build import build_deepspeed_engine
from hybridlm.engine.checkpoint_store import CheckpointStore
from hybridlm.engine.config import OptimConfig
from hybridlm.engine.distributed import DistInfo, init_distributed
from hybridlm.engine.step_runner import (EvalResult, LossFn, NonFiniteLossError, PendingStep, StepResult,
                                         StepRunner)

__all__ = ["Engine", "EvalResult", "LossFn", "NonFiniteLossError", "PendingStep", "StepResult"]


def _counter(name: str, doc: str) -> property:
    """An :class:`Engine` attribute kept by its :class:`StepRunner`."""
    return property(lambda self: getattr(self._steps, name), lambda self, value: setattr(self._steps, name, value),
                    doc=doc)


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
        named_groups: instead of ``trainable``, the parameters to train by group name; ``optim.group_lr`` sets
            a group's peak learning rate (0: frozen); a name it does not give trains at ``optim.lr``.
        ds_overrides: extra keys merged into the DeepSpeed config (advanced use).

    Constructing an engine seeds python/numpy/torch RNGs with ``config.seed + rank``.
    """

    global_step = _counter("global_step", "Optimizer steps attempted (applied + skipped).")
    skipped_steps = _counter("skipped_steps", "Optimizer steps skipped for a non-finite loss or gradient norm.")
    consecutive_nonfinite = _counter("consecutive_nonfinite", "Steps skipped in a row up to the last one.")

    def __init__(
        self,
        model: nn.Module,
        config: OptimConfig,
        loss_fn: LossFn,
        *,
        trainable: Optional[Iterable[nn.Parameter]] = None,
        named_groups: Optional[Mapping[str, Iterable[nn.Parameter]]] = None,
        ds_overrides: Optional[Mapping[str, Any]] = None,
    ) -> None:
        config.validate("optim")
        self.config = config
        self.loss_fn = loss_fn
        self.dist: DistInfo = init_distributed()
        self.gradient_accumulation_steps = config.gradient_accumulation_steps(self.dist.world_size)
        built = build_deepspeed_engine(model, config, self.dist, trainable=trainable, named_groups=named_groups,
                                       ds_overrides=ds_overrides)
        self.deepspeed = built.deepspeed
        # DeepSpeed's engine, its ZeRO / bf16 optimizer and the schedule, for callers that inspect them
        self.ds_engine, self.optimizer = self.deepspeed.engine, self.deepspeed.optimizer
        self.lr_scheduler = self.deepspeed.lr_scheduler
        self._steps = StepRunner(self.deepspeed, config, self.dist, first_group_lr=built.group_lr[0])
        self._checkpoints = CheckpointStore(self.deepspeed, config, self.dist, built.group_decay,
                                            built.group_lr, built.group_layout)
        self.module: nn.Module = self.deepspeed.module
        self.device = self.dist.device
        self.resume_note: Optional[str] = None  # set by load_checkpoint when a setting changed since the save

    # ------------------------------------------------------------------------------ properties

    @property
    def model(self) -> nn.Module:
        """The DeepSpeed engine: what ``loss_fn`` receives."""
        return self.deepspeed.model

    @property
    def lr(self) -> float:
        """Learning rate the next step will use."""
        return self._steps.lr

    @property
    def applied_steps(self) -> int:
        return self.global_step - self.skipped_steps

    # ------------------------------------------------------------------------------ training

    def train_step(self, micro_batches: Sequence[Mapping[str, Any]],
                   before_optimizer_step: Optional[Callable[[], None]] = None) -> StepResult:
        """One optimizer step over this rank's ``gradient_accumulation_steps`` micro-batches, its results read
        at once (:meth:`launch_step` launches it without waiting for them)."""
        return self.launch_step(micro_batches, before_optimizer_step).result()

    def launch_step(self, micro_batches: Sequence[Mapping[str, Any]],
                    before_optimizer_step: Optional[Callable[[], None]] = None) -> PendingStep:
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
        return self._steps.launch(self.loss_fn, micro_batches, before_optimizer_step)

    def eval_step(self, batch: Mapping[str, Any]) -> EvalResult:
        """Loss and metrics of one batch on this rank, in eval mode, without gradients."""
        return self._steps.evaluate(self.loss_fn, batch)

    # ------------------------------------------------------------------------------ checkpoints

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
        self._steps.settle()  # the counters and the schedule saved must include the last step's skip
        return self._checkpoints.save(save_dir, step, client_state, self._steps.counters(), keep_last=keep_last)

    def load_checkpoint(self, path: str, *, required: bool = False) -> Optional[Dict[str, Any]]:
        """Restore model, optimizer, scheduler, RNG and counters; return the saved ``client_state``.

        ``path`` is a save directory (the checkpoint named by its ``latest`` file is loaded) or one
        ``step_<N>`` directory. It may have been saved on another number of ranks
        (:meth:`DeepSpeedAdapter.load_resharded_optimizer`).  Returns None when ``path`` is a directory holding no
        checkpoint yet (unless ``required``).  A missing path, a dangling ``latest``, an incomplete or unreadable
        checkpoint raise :class:`CheckpointError` (a ``ConfigError``) naming the path.  Collective.
        """
        restored = self._checkpoints.load(path, required=required)
        if restored is None:
            return None
        self._steps.restore(restored.counters)
        self.resume_note = restored.resume_note
        return restored.client_state
