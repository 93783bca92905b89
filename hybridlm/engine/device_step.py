"""The bf16 optimizer step without a host sync: the skip of a non-finite step decided on the device.

DeepSpeed's ``BF16_Optimizer.step`` (ZeRO-1, bf16 weights, fp32 gradient accumulation) reads the gradient norm
on the host to decide whether to skip the step (``get_global_norm_of_tensors`` masks it with a host-made tensor,
``is_invalid_grad_norm`` reads it). So every step waits there for its backward, and the next forward is launched
only after the optimizer, with the GPU's queue nearly empty: every step the GPU then waits for the host to launch
the forward's first layers (BENCHMARKS.md, "Training step breakdown"; the switch: "Switches").

:func:`step_on_device` replaces that step on one optimizer instance. It takes the norm over every rank's partition
of the flat fp32 gradients (hybridlm/engine/clipping.py ``global_norm``), clips this rank's partitions by
``min(1, max_norm / (norm + 1e-6))`` and hands fused AdamW ``found_inf = not isfinite(norm)``: a non-finite step
then leaves the fp32 master weights, both moments and AdamW's step count as they were, on the device (torch's
fused AdamW subtracts ``found_inf`` from the step count it advanced). The host learns whether the step was
skipped when it reads the step's results; the engine advances the LR schedule then
(:class:`ScheduleAdvancedByEngine`), before the next step's optimizer runs, so a skipped step does not advance
it, as in DeepSpeed's own skip (hybridlm/engine/step_runner.py, module docstring).
"""
from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

from hybridlm.engine.checkpoint_store import link_optimizer_state, set_deepspeed_grad_norm
from hybridlm.engine.clipping import global_norm, scale_to_max_norm


class ScheduleAdvancedByEngine(LambdaLR):
    """A LambdaLR that ignores DeepSpeed's ``step()`` after each optimizer step; the engine calls
    :meth:`advance` once it has read that the step was applied. State and checkpoints are LambdaLR's."""

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


def step_on_device(bf16_optimizer, max_norm: float) -> None:
    """Replace ``bf16_optimizer.step`` (DeepSpeed's ``BF16_Optimizer``, wrapping a fused torch AdamW) by a step
    that never reads the device. After each step ``bf16_optimizer.found_inf`` is a 0-d float tensor, 1.0 when the
    step was skipped, and the norm that ``DeepSpeedEngine.get_global_grad_norm`` reports is the norm before
    clipping (a tensor)."""
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
        norm = global_norm(partitions, reference=partitions[0])  # this rank's partitions, summed over ranks
        found_inf = (~torch.isfinite(norm)).float()
        if max_norm > 0:
            scale_to_max_norm(partitions, norm, max_norm)
        for master, grad in zip(opt.fp32_groups_flat_partition, partitions):
            master.grad = grad
        adamw.grad_scale, adamw.found_inf = None, found_inf
        adamw.step()
        set_deepspeed_grad_norm(opt, norm)
        opt.found_inf = found_inf
        link_optimizer_state(opt)
        opt.update_lp_params()  # unchanged masters on a skipped step: the copy changes nothing
        opt.clear_hp_grads()

    bf16_optimizer.step = step
