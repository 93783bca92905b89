"""The one error type a user sees for bad configuration: a single line naming the field."""
import struct

from safetensors import SafetensorError


class ConfigError(ValueError):
    """Raised for any invalid configuration value; the message names the field and what was expected."""


class CheckpointError(ConfigError):
    """A checkpoint path that is missing, incomplete or unreadable (one line naming the path)."""


def last_line(text) -> str:
    """The last non-empty line of an error message or a tool's output (what a one-line error quotes)."""
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def weight_load_errors() -> tuple:
    """What loading a checkpoint can raise for a damaged or mismatched file: OS / value / key / runtime /
    type errors, a truncated safetensors header (``SafetensorError``), a truncated GGUF (``struct.error``)."""

    return (OSError, ValueError, KeyError, RuntimeError, TypeError, struct.error, SafetensorError)
