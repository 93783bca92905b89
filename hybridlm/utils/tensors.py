"""One walk over the tensors inside a batch-like structure."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, at any depth of mappings (returned as dicts), named
    tuples, lists and tuples; anything else is returned as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj
