"""What the engine trains and how its optimizer steps: the trainable parameters, AdamW and its groups, the
schedule, and the clipping or the step on the device that DeepSpeed's optimizer runs with (every DeepSpeed call
through hybridlm/engine/deepspeed_adapter.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from hybridlm.config.errors import ConfigError
from hybridlm.engine.checkpoint import seed_everything
from hybridlm.engine.clipping import clip_before_step, global_norm, scale_to_max_norm
from hybridlm.engine.config import OptimConfig
from hybridlm.engine.deepspeed_adapter import DeepSpeedAdapter, clips_in_engine, deepspeed_config
from hybridlm.engine.distributed import DistInfo
from hybridlm.engine.schedule import lr_lambda_from_config


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
    return _decay_split(params, weight_decay)


def _decay_split(params: Iterable[nn.Parameter], weight_decay: float, seen: Optional[set] = None,
                 **extra: Any) -> List[Dict[str, Any]]:
    """``[decay, no_decay]`` groups (the empty ones left out) of ``params``, each with ``extra`` keys; a parameter
    already in ``seen`` is skipped."""
    seen = set() if seen is None else seen
    decay, no_decay = [], []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if no_weight_decay(p) else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, **extra})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, **extra})
    return groups


def named_param_groups(named: Mapping[str, Iterable[nn.Parameter]], config: OptimConfig) -> List[Dict[str, Any]]:
    """AdamW param groups of named parameter groups (a parameter counts in the first group that holds it): each
    name's ``[decay, no_decay]`` at its peak lr (``optim.group_lr``, else ``optim.lr``) and the name under
    ``"group"``; a group at lr 0 is frozen, so it is left out. A ``group_lr`` key that names no group is refused."""
    unknown = sorted(set(config.group_lr) - set(named))
    if unknown:
        raise ConfigError(f"optim.group_lr.{unknown[0]}: not a parameter group of this run; expected one of "
                          f"{', '.join(named) or '(none: this run has no named groups)'}")
    seen: set = set()
    groups = []
    for name, params in named.items():
        lr = config.lr_of(name)
        if lr == 0:
            seen.update(id(p) for p in params)
            continue
        groups += _decay_split(params, config.weight_decay, seen, lr=lr, group=name)
    return groups


@dataclass
class BuiltEngine:
    """What :func:`build_deepspeed_engine` returns."""

    deepspeed: DeepSpeedAdapter  # the DeepSpeed engine, its optimizer and the schedule
    group_decay: List[float]  # each AdamW param group's weight decay
    group_lr: List[float]  # each AdamW param group's peak learning rate
    group_layout: List[Tuple[str, int]]  # each AdamW param group's name ("" unnamed) and parameter count


def _freeze_all_but(model: nn.Module, trainable: List[nn.Parameter]) -> None:
    ids = {id(p) for p in trainable}
    if not ids <= {id(p) for p in model.parameters()}:
        raise ValueError("Engine: every parameter in `trainable` must belong to `model`")
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    for p in trainable:
        p.requires_grad_(True)


def _enable_activation_checkpointing(model: nn.Module) -> None:
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"optim.activation_checkpointing: {type(model).__name__} does not support it")
    # transformers 5.24 names it activation_checkpointing_enable and warns on the old name
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_deepspeed_engine(model: nn.Module, config: OptimConfig, dist_info: DistInfo, *,
                           trainable: Optional[Iterable[nn.Parameter]] = None,
                           named_groups: Optional[Mapping[str, Iterable[nn.Parameter]]] = None,
                           ds_overrides: Optional[Mapping[str, Any]] = None) -> BuiltEngine:
    """``model`` (frozen but for ``trainable`` or the unfrozen ``named_groups`` when given) on this rank's device,
    wrapped by DeepSpeed with a torch AdamW and the warmup + cosine schedule (each group scaled to its own lr). Seeds python/numpy/torch RNGs with ``config.seed + rank``."""
    if named_groups is not None:
        if trainable is not None:
            raise ValueError("Engine: give trainable or named_groups, not both")
        groups = named_param_groups(named_groups, config)
        if not groups:
            raise ConfigError(f"optim.group_lr: every parameter group is frozen ({config.group_lr}); nothing trains")
        _freeze_all_but(model, [p for g in groups for p in g["params"]])
    else:
        if config.group_lr:
            raise ConfigError(f"optim.group_lr: this run names no parameter groups (its parameters all train at "
                              f"optim.lr); remove group_lr")
        if trainable is not None:
            trainable = list(trainable)
            _freeze_all_but(model, trainable)
        groups = build_param_groups(model, config.weight_decay, trainable)
    if not groups:
        raise ValueError("Engine: the model has no trainable parameters")
    # read before the schedule scales the groups' "lr" in place
    peak_lr = [g.get("lr", config.lr) for g in groups]
    layout = [(g.get("group", ""), sum(p.numel() for p in g["params"])) for g in groups]
    if config.activation_checkpointing:
        _enable_activation_checkpointing(model)
    seed_everything(config.seed + dist_info.rank)
    model.to(dist_info.device)
    optimizer = torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=tuple(config.betas),
        eps=config.eps,
        weight_decay=config.weight_decay,
        # fused on a GPU; and wherever the step runs on the device, which skips through fused AdamW's found_inf
        fused=dist_info.device.type == "cuda" or config.step_on_device,
    )
    factor = lr_lambda_from_config(config)

    ds_config = deepspeed_config(config, dist_info.world_size)
    if ds_overrides:
        ds_config.update(dict(ds_overrides))

    deepspeed = DeepSpeedAdapter.initialize(model, optimizer, factor, ds_config,
                                            schedule_advanced_by_engine=config.step_on_device)
    bf16_optimizer = deepspeed.bf16_optimizer
    if (clips_in_engine(config) or config.step_on_device) and not bf16_optimizer:
        raise RuntimeError(f"Engine: expected DeepSpeed's BF16_Optimizer for bf16 ZeRO-1, got "
                           f"{deepspeed.optimizer_name}; the engine's clipping and step assume it")
    if config.step_on_device:  # it clips too
        max_norm = config.grad_clip
        deepspeed.step_on_device(
            norm_of=lambda grads: global_norm(grads, reference=grads[0]),  # this rank's partitions, summed over ranks
            clip=(lambda grads, norm: scale_to_max_norm(grads, norm, max_norm)) if max_norm > 0 else None)
    elif clips_in_engine(config) and ds_config.get("gradient_clipping") == 0.0:  # not overridden
        # DeepSpeed's norm, taken just before it steps the optimizer (hybridlm/engine/clipping.py)
        clip_before_step(deepspeed.torch_optimizer, config.grad_clip, norm=deepspeed.step_grad_norm)
    if bf16_optimizer and not config.step_on_device:  # (the device step takes its own norm over the same buffers)
        deepspeed.norm_over_flat_gradients()
    if bf16_optimizer and dist_info.world_size == 1:
        deepspeed.skip_backward_allreduce()
    return BuiltEngine(deepspeed, [g["weight_decay"] for g in groups], peak_lr, layout)
