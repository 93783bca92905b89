"""Every touch of DeepSpeed: the one module that imports it or names its objects' attributes.

The engine's other rooms hold a :class:`DeepSpeedAdapter` and call its methods; none of them reaches into
DeepSpeed's engine, its ZeRO / bf16 optimizer, the parameters it links, its checkpoint files or its comm layer
(tests/test_engine_structure.py asks each module of the toolkit). This module imports no other room of the engine:
what it needs of them (the clipping arithmetic, the safe file loader, the schedule's factor) is handed in, so it
stands on the ground floor and a DeepSpeed upgrade changes this file only.

What it wraps:

* the process groups: DeepSpeed's comm layer creates or adopts them and destroys the groups it keeps;
* the DeepSpeed config dict (:func:`deepspeed_config`) and ``deepspeed.initialize``;
* the step: backward, DeepSpeed's step and its skip count, the gradient norm, the train / eval mode;
* how DeepSpeed's ``BF16_Optimizer`` (bf16 weights, fp32 gradient accumulation, ZeRO-1) clips, takes its norm
  and steps: the engine's clipping hook on the torch AdamW it wraps (hybridlm/engine/clipping.py), its norm over
  the flat gradient buffers, its step replaced by one that never reads the device (:meth:`step_on_device`), its
  all-reduce of one rank's gradients left out;
* the checkpoint state: DeepSpeed's save and load through a loader that unpickles only tensors and plain data,
  its file names, the ZeRO-1 optimizer state re-partitioned for another number of ranks, the optimizer's
  settings and the schedule's rates set after a load.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from hybridlm.config.errors import CheckpointError, ConfigError

Loader = Callable[..., Any]  # ``load(path, map_location=...)``: hybridlm/engine/checkpoint.py ``safe_load``

# --------------------------------------------------------------------------------------------- process groups


def init_process_group(backend: str, timeout: Optional[datetime.timedelta] = None) -> None:
    """Create the default process group through DeepSpeed's comm layer, or let it adopt one that exists
    (``timeout`` None: DeepSpeed's default)."""
    import deepspeed

    if timeout is None:
        deepspeed.init_distributed(dist_backend=backend)
    else:
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def destroy_process_groups() -> bool:
    """Destroy every process group through DeepSpeed's comm layer when it adopted them, which also releases the
    groups it keeps in ``deepspeed.utils.groups`` (its clone of the world group is the ZeRO data-parallel group).
    False when it holds none (nothing done)."""
    ds_comm = sys.modules.get("deepspeed.comm")  # not imported: nothing of DeepSpeed's to destroy
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
        return True
    return False


# ----------------------------------------------------------------------------------------------- its config


def clips_in_engine(cfg) -> bool:
    """Whether the engine clips the gradients itself: where DeepSpeed runs its ``BF16_Optimizer`` (bf16 weights,
    fp32 gradient accumulation, ZeRO-1), whose clipping loop the GPU waits for (hybridlm/engine/clipping.py).
    ``cfg``: an :class:`~hybridlm.engine.config.OptimConfig`."""
    return cfg.precision == "bf16" and cfg.zero_stage == 1 and cfg.grad_clip > 0


def deepspeed_config(cfg, world_size: int) -> Dict[str, Any]:
    """The DeepSpeed config dict the engine runs with (no optimizer/scheduler: both are passed in).
    ``cfg``: an :class:`~hybridlm.engine.config.OptimConfig`."""
    gas = cfg.gradient_accumulation_steps(world_size)
    bf16 = cfg.precision == "bf16"
    ds: Dict[str, Any] = {
        "train_batch_size": cfg.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": gas,
        # bf16 + ZeRO-1 clips in the engine (hybridlm/engine/clipping.py): DeepSpeed's loop there stalls the GPU
        "gradient_clipping": 0.0 if clips_in_engine(cfg) else float(cfg.grad_clip),
        "zero_optimization": {"stage": cfg.zero_stage},
        # check_grad_overflow: a non-finite gradient norm skips the update (hybridlm/engine/step_runner.py).
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


class ScheduleAdvancedByEngine(LambdaLR):
    """A LambdaLR that ignores DeepSpeed's ``step()`` after each optimizer step; the engine calls
    :meth:`advance` once it has read that the step was applied (:meth:`DeepSpeedAdapter.step_on_device`).
    State and checkpoints are LambdaLR's."""

    def __init__(self, optimizer, lr_lambda):
        self.held = False  # LambdaLR's constructor steps once, to set the initial rates
        super().__init__(optimizer, lr_lambda)
        self.held = True

    def step(self, *args, **kwargs):
        if not self.held:
            super().step(*args, **kwargs)

    def advance(self) -> None:
        self.held = False
        try:
            super().step()
        finally:
            self.held = True


# ------------------------------------------------------------------------------------------ checkpoint files

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"  # one per checkpoint: the model and the schedule
_OPTIMIZER_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_BF16_SHARD_PREFIX = "bf16_zero_pp_rank_"  # BF16_Optimizer's shards; the ZeRO optimizer's have no prefix


def checkpoint_records() -> list:
    """What DeepSpeed's checkpoints hold besides tensors and plain data (DeepSpeed 0.19): small records of its own
    (a loss scaler's settings, the ZeRO stage, where a bf16 fragment sits in its flat buffer). Unpickling them
    builds the object and sets its fields."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def saved_by_bf16_optimizer(file_names: Iterable[str]) -> bool:
    """Whether a checkpoint's files are ``BF16_Optimizer``'s (a bf16 run's) rather than the ZeRO optimizer's."""
    return any(str(n).startswith(_BF16_SHARD_PREFIX) for n in file_names)


def read_full_optimizer_state(tag_dir: str, saved_world_size: int,
                              load: Loader) -> Tuple[Dict[str, Dict[str, torch.Tensor]], float]:
    """Each parameter's full fp32 value and AdamW moments (``{name: {"fp32", "exp_avg", "exp_avg_sq"}}``) and the
    optimizer's step count, from the ZeRO optimizer shards of a checkpoint saved on ``saved_world_size`` ranks.

    Every saved shard records which slice of which parameter it holds (``param_slice_mappings``: name -> start and
    length in that rank's flat partition); the shards of all ranks, read in rank order, give each parameter whole.
    """
    shards = {int(m.group(1)): os.path.join(tag_dir, f) for f in os.listdir(tag_dir)
              if (m := _OPTIMIZER_SHARD.match(f))}
    if sorted(shards) != list(range(saved_world_size)):
        raise CheckpointError(f"checkpoint {tag_dir}: expected the optimizer shards of ranks "
                              f"0..{saved_world_size - 1}, found {sorted(shards)}")
    pieces: Dict[str, Dict[str, List[torch.Tensor]]] = {}
    steps = set()
    for r in range(saved_world_size):
        sd = load(shards[r])["optimizer_state_dict"]
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
    return full, steps.pop()


# ----------------------------------------------------------------------------------------------- the adapter


class DeepSpeedAdapter:
    """DeepSpeed's engine, its optimizer and the schedule it steps, behind the operations the engine needs.

    ``model`` is what a ``loss_fn`` receives (the DeepSpeed engine: calling it runs ``module.forward``);
    ``module`` the model trained; ``torch_optimizer`` the torch AdamW that DeepSpeed's optimizer steps (its
    param groups hold the learning rates); ``lr_scheduler`` the schedule."""

    def __init__(self, engine, optimizer, lr_scheduler) -> None:
        self.engine = engine  # deepspeed.DeepSpeedEngine
        self.optimizer = optimizer  # DeepSpeed's ZeRO or bf16 optimizer, wrapping the torch AdamW
        self.lr_scheduler = lr_scheduler  # LambdaLR, or ScheduleAdvancedByEngine

    @classmethod
    def initialize(cls, model: nn.Module, optimizer: torch.optim.Optimizer, factor: Callable[[int], float],
                   ds_config: Dict[str, Any], *, schedule_advanced_by_engine: bool) -> "DeepSpeedAdapter":
        """``deepspeed.initialize`` of ``model`` with the torch ``optimizer`` and a LambdaLR of ``factor`` (a
        :class:`ScheduleAdvancedByEngine` when ``schedule_advanced_by_engine``)."""
        import deepspeed

        engine, zero_optimizer, _, lr_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: (ScheduleAdvancedByEngine(opt, factor) if schedule_advanced_by_engine
                                      else torch.optim.lr_scheduler.LambdaLR(opt, factor)),
            config=ds_config,
            dist_init_required=False,
        )
        return cls(engine, zero_optimizer, lr_scheduler)

    # ---------------------------------------------------------------------------------------- handles

    @property
    def model(self) -> nn.Module:
        return self.engine

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.engine.basic_optimizer

    @property
    def bf16_optimizer(self) -> bool:
        """Whether DeepSpeed chose its ``BF16_Optimizer`` (bf16 ZeRO-1 with fp32 gradient accumulation)."""
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        return isinstance(self.optimizer, BF16_Optimizer)

    @property
    def optimizer_name(self) -> str:
        return type(self.optimizer).__name__

    # ------------------------------------------------------------------------------------------- step

    @property
    def lr(self) -> float:
        """The learning rate of the first param group, which the next step uses."""
        return float(self.engine.basic_optimizer.param_groups[0]["lr"])

    @property
    def skipped_steps(self) -> int:
        """Steps DeepSpeed skipped for a non-finite gradient norm (its own count, not the engine's)."""
        return self.engine.skipped_steps

    def ensure_training(self) -> None:
        """Training mode; ``train()`` walks every module, host time the GPU waits for: only on a change of the
        inner module's mode (DeepSpeedEngine.eval() leaves its own flag set)."""
        if not self.engine.module.training:
            self.engine.train()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """Eval mode for the block (the mode before it put back after); yields :attr:`model`."""
        was_training = self.engine.training
        self.engine.eval()
        try:
            yield self.engine
        finally:
            self.engine.train(was_training)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        """DeepSpeed's step: the optimizer's at the last micro-batch of an accumulation, else nothing."""
        self.engine.step()

    def grad_norm(self) -> Any:
        """The last step's gradient norm before clipping (a number or a 0-d tensor; None when not taken)."""
        return self.engine.get_global_grad_norm()

    def found_inf(self) -> torch.Tensor:
        """After a :meth:`step_on_device` step: a 0-d float tensor, 1.0 when the step was skipped."""
        return self.optimizer.found_inf

    def advance_schedule(self) -> None:
        """After a :meth:`step_on_device` step read as applied: the schedule's step."""
        self.lr_scheduler.advance()

    # ------------------------------------------------------------------------------- clipping and steps

    def step_grad_norm(self) -> Any:
        """The gradient norm DeepSpeed's optimizer took in its current step (before clipping)."""
        return self.optimizer._global_grad_norm

    def skip_backward_allreduce(self) -> None:
        """One rank: DeepSpeed's all-reduce of the fp32 gradient sums is a flatten into its bf16 communication
        dtype, a reduce over one rank and a copy back (passes over every gradient each step); it would also round
        sums accumulated over micro-batches to bf16. Several ranks communicate in bf16 (DeepSpeed's
        communication_data_type)."""
        self.engine.enable_backward_allreduce = False

    def norm_over_flat_gradients(self) -> None:
        """Make ``BF16_Optimizer`` take its gradient norm over its flat fp32 gradient buffers (one norm per
        parameter group) instead of over each parameter's view of them. Same value: every parameter's gradient is
        a view of its group's buffer, which holds zeros where a parameter got no gradient (DeepSpeed zeroes it
        after each step) and is cut before its alignment padding. Under ZeRO-1 every rank holds the whole reduced
        gradient, so the norm needs no communication, as DeepSpeed's own. Not for pipeline, tensor or expert
        parallelism, whose parameters DeepSpeed filters or groups apart (the engine uses none)."""
        flat = list(self.optimizer.fp32_groups_actual_gradients_flat)

        def grads_for_norm(for_clipping: bool = False):
            return list(flat) if for_clipping else (list(flat), {})

        self.optimizer.get_grads_for_norm = grads_for_norm

    def step_on_device(self, norm_of: Callable[[List[torch.Tensor]], torch.Tensor],
                       clip: Optional[Callable[[List[torch.Tensor], torch.Tensor], None]]) -> None:
        """Replace ``BF16_Optimizer.step`` (wrapping a fused torch AdamW) by a step that never reads the device.

        DeepSpeed's ``BF16_Optimizer.step`` reads the gradient norm on the host to decide whether to skip the step
        (``get_global_norm_of_tensors`` masks it with a host-made tensor, ``is_invalid_grad_norm`` reads it). So
        every step waits there for its backward, and the next forward is launched only after the optimizer, with
        the GPU's queue nearly empty: every step the GPU then waits for the host to launch the forward's first
        layers (BENCHMARKS.md, "Training step breakdown"; the switch: ``optim.step_on_device``).

        The step here takes ``norm_of(partitions)``, the norm over every rank's partition of the flat fp32
        gradients (hybridlm/engine/clipping.py ``global_norm``), lets ``clip(partitions, norm)`` (if given) scale
        this rank's partitions by ``min(1, max_norm / (norm + 1e-6))`` and hands fused AdamW
        ``found_inf = not isfinite(norm)``: a non-finite step then leaves the fp32 master weights, both moments
        and AdamW's step count as they were, on the device (torch's fused AdamW subtracts ``found_inf`` from the
        step count it advanced). After each step :meth:`found_inf` is 1.0 when the step was skipped and
        :meth:`grad_norm` the norm before clipping (a tensor). The host learns whether the step was skipped when
        it reads the step's results; the engine advances the LR schedule then (:class:`ScheduleAdvancedByEngine`,
        :meth:`advance_schedule`), before the next step's optimizer runs, so a skipped step does not advance it,
        as in DeepSpeed's own skip (hybridlm/engine/step_runner.py, module docstring)."""
        bf16_optimizer = self.optimizer
        adamw = bf16_optimizer.optimizer
        if not all(g.get("fused") for g in adamw.param_groups):
            raise ValueError("step_on_device: the wrapped optimizer must be a fused torch AdamW (it skips a step "
                             "through found_inf)")
        partitions = list(bf16_optimizer.fp32_groups_gradient_flat_partition)

        @torch.no_grad()
        def step(closure=None):
            if closure is not None:
                raise NotImplementedError("step_on_device: no closure")
            opt = bf16_optimizer
            opt.overflow = False  # the host does not know; the engine reads found_inf with the step's results
            norm = norm_of(partitions)
            found_inf = (~torch.isfinite(norm)).float()
            if clip is not None:
                clip(partitions, norm)
            for master, grad in zip(opt.fp32_groups_flat_partition, partitions):
                master.grad = grad
            adamw.grad_scale, adamw.found_inf = None, found_inf
            adamw.step()
            opt._global_grad_norm = norm  # where DeepSpeedEngine.get_global_grad_norm reads it
            opt.found_inf = found_inf
            opt._lazy_init_hp_params_optimizer_state()  # the per-parameter views of the AdamW state, once
            opt.update_lp_params()  # unchanged masters on a skipped step: the copy changes nothing
            opt.clear_hp_grads()

        bf16_optimizer.step = step

    # -------------------------------------------------------------------------------------- checkpoints

    def load_files_with(self, load: Loader) -> None:
        """Every DeepSpeed read of a checkpoint (model states, ZeRO optimizer shards) through ``load``: DeepSpeed's
        torch checkpoint engine with its ``load`` replaced (saving unchanged); DeepSpeed's own unpickles with
        ``weights_only=False``."""
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        base = self.engine.checkpoint_engine
        if type(base) is not TorchCheckpointEngine:
            raise ConfigError(f"Engine: DeepSpeed chose the checkpoint engine {type(base).__name__}; only the torch "
                              "checkpoint engine is supported (its loads are made safe)")

        class SafeTorchCheckpointEngine(TorchCheckpointEngine):
            def load(self, path: str, map_location=None):
                return load(path, map_location=map_location)

        safe = SafeTorchCheckpointEngine.__new__(SafeTorchCheckpointEngine)
        safe.__dict__.update(base.__dict__)  # the same settings (serialization format, name)
        self.engine.checkpoint_engine = safe

    def save(self, save_dir: str, tag: str, client_state: Dict[str, Any]) -> None:
        """DeepSpeed's files of the model, optimizer and schedule into ``<save_dir>/<tag>`` (no ``latest``)."""
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)

    def load(self, save_dir: str, tag: str, with_optimizer: bool) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        """The model and schedule (and the optimizer state when ``with_optimizer``) of ``<save_dir>/<tag>``; returns
        DeepSpeed's ``(path loaded, client state)``, ``(None, None)`` when it found nothing."""
        return self.engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=with_optimizer,
                                           load_lr_scheduler_states=True)

    def load_resharded_optimizer(self, tag_dir: str, saved_world_size: int, load: Loader) -> None:
        """The fp32 master weights and AdamW moments of a checkpoint saved on ``saved_world_size`` ranks, put into
        this engine's ZeRO partition on the current number of ranks (shards read through ``load``,
        :func:`read_full_optimizer_state`).

        Each current rank copies the slice of every parameter that its own partition holds (DeepSpeed's
        ``_hp_mapping`` of each parameter: where the slice starts in the parameter and in the partition). Values
        are copied, not recomputed, so the state is exact; the step count is the saved one.
        """
        full, step = read_full_optimizer_state(tag_dir, saved_world_size, load)
        base = self.engine.optimizer.optimizer  # the torch AdamW stepping the flat fp32 partitions
        for group in base.param_groups:  # AdamW creates its state at the first step: create it now
            flat = group["params"][0]
            on_device = group.get("fused") or group.get("capturable")
            base.state[flat] = {"step": torch.tensor(step, dtype=torch.float32,
                                                     device=flat.device if on_device else "cpu"),
                                "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
        for name, param in self.engine.module.named_parameters():
            mapping = getattr(param, "_hp_mapping", None)  # where this rank's partition holds a slice of it
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
        for group, lr in zip(base.param_groups, self.engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
        self.engine.optimizer._link_all_hp_params()  # the per-parameter views of the new state, made again

    @property
    def applied_updates(self) -> int:
        """Updates the schedule has counted (applied steps, the saved ones included)."""
        return int(self.lr_scheduler.last_epoch)

    def set_optimizer_settings(self, base_lrs: Sequence[float], lrs: Sequence[float], decays: Sequence[float],
                               betas: Tuple[float, float], eps: float) -> None:
        """After a load: the schedule's peak rates (``base_lrs``) and the rates it reports and saves
        (``get_last_lr``: ``lrs``); each param group's ``lr``, ``weight_decay``, ``betas`` and ``eps`` in the
        AdamW that DeepSpeed steps (where the step reads them)."""
        self.lr_scheduler.base_lrs = list(base_lrs)
        for group, lr, decay in zip(self.engine.basic_optimizer.param_groups, lrs, decays):
            group["lr"] = lr
            group["weight_decay"] = decay
            group["betas"] = tuple(betas)
            group["eps"] = eps
        self.lr_scheduler._last_lr = list(lrs)
