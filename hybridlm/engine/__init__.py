"""The shared training engine: distributed setup, optimisation config, LR schedule, DeepSpeed engine (docs/design.md,
"The engine's rooms")."""
from hybridlm.engine.build import build_param_groups, no_weight_decay
from hybridlm.engine.checkpoint import CheckpointError, get_rng_state, seed_everything, set_rng_state
from hybridlm.engine.config import OptimConfig
from hybridlm.engine.deepspeed_adapter import deepspeed_config
from hybridlm.engine.distributed import (DistInfo, all_reduce_flag, all_reduce_sum, barrier, free_port, get_dist_info,
                                         init_distributed, is_main, shutdown_distributed, world_size)
from hybridlm.engine.engine import Engine
from hybridlm.engine.schedule import lr_at, lr_lambda, lr_lambda_from_config
from hybridlm.engine.step_runner import EvalResult, LossFn, NonFiniteLossError, PendingStep, StepResult

__all__ = [
    "CheckpointError", "DistInfo", "Engine", "EvalResult", "LossFn", "NonFiniteLossError", "PendingStep",
    "OptimConfig", "StepResult", "all_reduce_flag", "all_reduce_sum", "barrier", "build_param_groups",
    "deepspeed_config", "free_port", "get_dist_info", "get_rng_state", "init_distributed", "is_main", "lr_at",
    "lr_lambda", "lr_lambda_from_config", "no_weight_decay", "seed_everything", "set_rng_state",
    "shutdown_distributed", "world_size",
]
