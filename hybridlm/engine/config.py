"""Optimisation settings shared by every stage (the ``optim:`` block of a stage config)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

from hybridlm.config.errors import ConfigError

# bf16: bf16 weights and activations, fp32 master weights and gradient accumulation (DeepSpeed's bf16 mode);
# bf16-mixed: fp32 weights, the forward under torch.autocast(bf16) (DeepSpeed's torch_autocast): matmuls in bf16,
#   norms, residual stream, gates and the loss in fp32, as fla's and transformers' own training recipes run;
# fp32: everything fp32. docs/precision.md compares them.
PRECISIONS = ("bf16", "bf16-mixed", "fp32")
# the dtype of a frozen model (teacher, reference) beside a student trained at each precision
COMPUTE_DTYPES = {"bf16": "bfloat16", "bf16-mixed": "bfloat16", "fp32": "float32"}
ZERO_STAGES = (1, 2)


@dataclass
class OptimConfig:
    """Batch sizes, AdamW, schedule, precision and ZeRO settings for :class:`hybridlm.engine.Engine`.

    Batch semantics are DeepSpeed's: ``global_batch_size`` sequences per optimizer step
    = ``micro_batch_size`` per forward on each rank x world size x gradient-accumulation steps.
    """

    micro_batch_size: int
    global_batch_size: int
    lr: float
    max_steps: int
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.01
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping
    precision: str = "bf16"  # one of PRECISIONS (above)
    zero_stage: int = 1
    seed: int = 42
    max_consecutive_nonfinite: int = 5
    # recompute each block's activations in the backward pass (transformers' gradient checkpointing):
    # about a third more compute for a micro-batch several times larger
    activation_checkpointing: bool = False

    def validate(self, where: str = "optim") -> None:
        def bad(field: str, expected: str) -> ConfigError:
            return ConfigError(f"{where}.{field}: expected {expected}, got {getattr(self, field)!r}")

        def finite(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        for name in ("micro_batch_size", "global_batch_size", "max_steps", "max_consecutive_nonfinite"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "a positive integer")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise bad("warmup_steps", "a non-negative integer")
        if self.warmup_steps > self.max_steps:
            raise ConfigError(
                f"{where}.warmup_steps: expected at most max_steps={self.max_steps}, got {self.warmup_steps}"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"{where}.global_batch_size: {self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        if not finite(self.lr) or self.lr <= 0:
            raise bad("lr", "a finite number > 0")
        if not finite(self.min_lr) or not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"{where}.min_lr: expected a number in [0, lr={self.lr}], got {self.min_lr!r}")
        if not finite(self.weight_decay) or self.weight_decay < 0:
            raise bad("weight_decay", "a finite number >= 0")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(finite(b) and 0 <= b < 1 for b in betas):
            raise bad("betas", "two numbers in [0, 1)")
        self.betas = (float(betas[0]), float(betas[1]))
        if not finite(self.eps) or self.eps <= 0:
            raise bad("eps", "a finite number > 0")
        if not finite(self.grad_clip) or self.grad_clip < 0:
            raise bad("grad_clip", "a finite number >= 0 (0 disables clipping)")
        if self.precision not in PRECISIONS:
            raise bad("precision", " or ".join(repr(p) for p in PRECISIONS))
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise bad("zero_stage", " or ".join(str(s) for s in ZERO_STAGES))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise bad("seed", "a non-negative integer")
        if not isinstance(self.activation_checkpointing, bool):
            raise bad("activation_checkpointing", "true or false")

    def gradient_accumulation_steps(self, world_size: int, where: str = "optim") -> int:
        """Micro-batches per rank per optimizer step: global / (micro x world size)."""
        per_pass = self.micro_batch_size * world_size
        if self.global_batch_size % per_pass:
            raise ConfigError(
                f"{where}.global_batch_size: {self.global_batch_size} is not divisible by "
                f"micro_batch_size ({self.micro_batch_size}) x world size ({world_size}) = {per_pass}"
            )
        return self.global_batch_size // per_pass
