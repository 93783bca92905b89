"""Third-party output our users cannot act on, silenced where it starts."""
from __future__ import annotations

import contextlib

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def no_transformers_bars():
    """transformers draws a bar for loading ("Loading weights") and writing ("Writing model shards") a model's
    weights; ours load and save in seconds, and the commands print their own line for each."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
