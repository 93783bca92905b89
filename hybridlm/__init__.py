"""Hybrid language models (MLA + Mamba2 / Gated DeltaNet / KDA): model, engine, data, ops, training loop."""
import os as _os

import torch as _torch

# Without a CUDA device, name DeepSpeed's CPU accelerator before anything imports DeepSpeed (transformers does, on
# save and load): its auto-detection reaches the same choice but logs a warning on every command.
if "DS_ACCELERATOR" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["DS_ACCELERATOR"] = "cpu"
