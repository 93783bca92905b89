"""Optimisation settings shared by every stage (the ``optim:`` block of a stage config)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Tuple

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting
from hybridlm.engine.schedule import SCHEDULES

# bf16: bf16 weights and activations, fp32 master weights and gradient accumulation (DeepSpeed's bf16 mode);
# bf16-mixed: fp32 weights, the forward under torch.autocast(bf16) (DeepSpeed's torch_autocast): matmuls in bf16,
#   norms, residual stream, gates and the loss in fp32, as fla's and transformers' own training recipes run;
# fp32: everything fp32. docs/precision.md compares them.
PRECISIONS = ("bf16", "bf16-mixed", "fp32")
# the dtype of a frozen model (teacher, reference) beside a student trained at each precision
COMPUTE_DTYPES = {"bf16": "bfloat16", "bf16-mixed": "bfloat16", "fp32": "float32"}
ZERO_STAGES = (1, 2)


@dataclass
class OptimConfig(Section):
    """Batch sizes, AdamW, schedule, precision and ZeRO settings for :class:`hybridlm.engine.Engine`.

    Batch semantics are DeepSpeed's: ``global_batch_size`` sequences per optimizer step
    = ``micro_batch_size`` per forward on each rank x world size x gradient-accumulation steps.
    """

    micro_batch_size: int = setting(ge=1)
    global_batch_size: int = setting(ge=1)
    lr: float = setting(gt=0)
    max_steps: int = setting(ge=1)
    min_lr: float = setting(0.0, ge=0)  # at most lr (validate); the floor of cosine and wsd
    warmup_steps: int = setting(0, ge=0)  # at most max_steps (validate)
    # after the warmup: cosine to min_lr over the run, wsd (the peak held, then a linear decay to min_lr over the
    # last decay_fraction of the post-warmup steps), or constant (hybridlm/engine/schedule.py)
    schedule: str = setting("cosine", choices=SCHEDULES)
    decay_fraction: float = setting(0.2, gt=0, le=1)  # wsd only
    weight_decay: float = setting(0.01, ge=0)
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = setting(1e-8, gt=0)
    grad_clip: float = setting(1.0, ge=0)  # max global L2 norm; 0 disables clipping
    precision: str = setting("bf16", choices=PRECISIONS)  # PRECISIONS (above)
    zero_stage: int = setting(1, choices=ZERO_STAGES)
    seed: int = setting(42, ge=0, lt=2**64)  # torch.manual_seed takes 64 bits
    max_consecutive_nonfinite: int = setting(5, ge=1)
    # recompute each block's activations in the backward pass (transformers' gradient checkpointing):
    # about a third more compute for a micro-batch several times larger
    activation_checkpointing: bool = False
    # bf16: add each parameter's bf16 gradient into its fp32 accumulator from a hook in the backward, as soon as
    # it is made (DeepSpeed's bf16.immediate_grad_update), rather than in a loop over all parameters after it
    immediate_grad_update: bool = False
    # bf16 ZeRO-1: decide on the device whether a non-finite step is skipped, so that no step waits on the host
    # for its backward (hybridlm/engine/deepspeed_adapter.py); the results are the same, the host learns of a skip when
    # it reads the step's results (at the latest before the next step's optimizer)
    step_on_device: bool = False
    # a learning rate per named parameter group of the run (the distillation stages name theirs: inherited,
    # mixer, latent; distill/param_groups.py); each group follows the run's schedule scaled to its own
    # lr (its floor min_lr x its lr / lr); 0 freezes the group. Parameters of unnamed groups train at lr.
    group_lr: Dict[str, float] = field(default_factory=dict)

    def validate(self, where: str = "optim") -> None:
        super().validate(where)
        if self.warmup_steps > self.max_steps:
            raise ConfigError(
                f"{where}.warmup_steps: expected at most max_steps={self.max_steps}, got {self.warmup_steps}"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"{where}.global_batch_size: {self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        if self.min_lr > self.lr:
            raise ConfigError(f"{where}.min_lr: expected a number in [0, lr={self.lr}], got {self.min_lr!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{where}.betas: expected two numbers in [0, 1), got {self.betas!r}")
        for name, value in self.group_lr.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}.group_lr.{name}: expected a learning rate >= 0 (0 freezes the group), "
                                  f"got {value!r}")
        if self.step_on_device and (self.precision != "bf16" or self.zero_stage != 1):
            raise ConfigError(f"{where}.step_on_device: needs precision=bf16 and zero_stage=1 (DeepSpeed's bf16 "
                              f"optimizer), got precision={self.precision}, zero_stage={self.zero_stage}")

    def gradient_accumulation_steps(self, world_size: int, where: str = "optim") -> int:
        """Micro-batches per rank per optimizer step: global / (micro x world size)."""
        per_pass = self.micro_batch_size * world_size
        if self.global_batch_size % per_pass:
            raise ConfigError(
                f"{where}.global_batch_size: {self.global_batch_size} is not divisible by "
                f"micro_batch_size ({self.micro_batch_size}) x world size ({world_size}) = {per_pass}"
            )
        return self.global_batch_size // per_pass

    def lr_of(self, group: str) -> float:
        """The peak learning rate of a named parameter group: its ``group_lr``, else ``lr``."""
        return self.group_lr.get(group, self.lr)
