"""The stage-independent training loop on top of :class:`hybridlm.engine.Engine`."""
from hybridlm.training.loop import RunConfig, TrainingOutcome, evaluate, train_loop

__all__ = ["RunConfig", "TrainingOutcome", "evaluate", "train_loop"]
