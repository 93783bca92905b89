"""Decoder-layer index lists (SMART's selection, the route's MLA layers, KV reports): validated, and read from a
command line's comma-separated text."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

from hybridlm.config.errors import ConfigError


def validate_layers(layers: Any, n_mla: Optional[int], num_layers: int, field: str = "layers",
                    what: str = "model") -> List[int]:
    """An explicit selection: integers in range, no duplicates, ``n_mla`` of them (when given); sorted.
    ``field`` / ``what`` name the config field and the thing the indices point into in error messages."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise ConfigError(f"{field}: expected a list of layer indices, got {layers!r}")
    layers = list(layers)
    seen = set()
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ConfigError(f"{field}: expected integer layer indices, got {i!r}")
        if not 0 <= i < num_layers:
            raise ConfigError(f"{field}: index {i} out of range for a {num_layers}-layer {what}")
        if i in seen:
            raise ConfigError(f"{field}: layer {i} is listed more than once")
        seen.add(i)
    if n_mla is not None and len(layers) != n_mla:
        raise ConfigError(f"{field}: expected {n_mla} layers (n_mla), got {len(layers)}")
    return sorted(layers)


def parse_layers(text: str, flag: str) -> List[int]:
    """The layer indices of a comma-separated command-line value such as ``0,5,10,14`` (``flag`` names the option
    in the error)."""
    try:
        return [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated layer indices such as 0,5,10,14, got {text!r}") from None
