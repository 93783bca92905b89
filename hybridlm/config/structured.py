"""Build typed dataclasses from YAML dicts, strictly: unknown keys, wrong types and values out of their declared
range are one-line errors naming the key.

A config section is a dataclass; its fields' types are the schema, and :func:`setting` adds what a type cannot
say (a lower bound, a range, a set of choices, non-empty). :func:`check_fields` checks a built object against
both, so a section built in code (``OptimConfig(...)``) is held to the same schema as one read from YAML; a
section's own ``validate`` keeps only what relates several fields.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Dict, Mapping, Optional, Sequence, Type, TypeVar

from hybridlm.config.errors import ConfigError

T = TypeVar("T")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any or value is None and (origin is typing.Union and type(None) in args):
        return value
    if origin is typing.Union:  # Optional[X] and friends: first member that accepts the value
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: {value!r} is not a valid {annotation}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):  # already built (and checked)
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return build_dataclass(annotation, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        if len(args) == 2:  # Dict[K, V]: each value built as V, named by its key
            return {k: _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string; accept what float() accepts
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


_MISSING = dataclasses.MISSING


def setting(default: Any = _MISSING, *, default_factory: Any = _MISSING, ge: Optional[float] = None,
            gt: Optional[float] = None, lt: Optional[float] = None, le: Optional[float] = None,
            choices: Optional[Sequence[Any]] = None, nonempty: Optional[str] = None) -> Any:
    """A dataclass field with constraints :func:`check_fields` enforces: ``ge`` / ``gt`` / ``le`` / ``lt`` bounds
    (numbers; a bounded number must also be finite), ``choices`` (the allowed values), ``nonempty`` (a string
    that must not be blank; the text says what is expected, e.g. ``"a directory path"``)."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, lt=lt, le=le, choices=choices, nonempty=nonempty).items()
            if v is not None}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _range_text(meta: Mapping[str, Any], integer: bool) -> str:
    kind = "an integer" if integer else "a number"
    low = ("ge", ">=") if "ge" in meta else ("gt", ">") if "gt" in meta else None
    high = ("le", "<=") if "le" in meta else ("lt", "<") if "lt" in meta else None
    if low and high:
        if low[0] == "gt" and high[0] == "lt":
            return f"{kind} strictly between {_fmt(meta['gt'])} and {_fmt(meta['lt'])}"
        lo_b, hi_b = "[" if low[0] == "ge" else "(", "]" if high[0] == "le" else ")"
        return f"{kind} in {lo_b}{_fmt(meta[low[0]])}, {_fmt(meta[high[0]])}{hi_b}"
    op, key = (low[1], low[0]) if low else (high[1], high[0])
    return f"{kind} {op} {_fmt(meta[key])}"


def _check_constraints(value: Any, meta: Mapping[str, Any], annotation: Any, where: str) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{where}: expected one of {', '.join(repr(c) for c in meta['choices'])}, got {value!r}")
    if "nonempty" in meta and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{where}: expected {meta['nonempty']}, got {value!r}")
    bounds = {k: meta[k] for k in ("ge", "gt", "le", "lt") if k in meta}
    if not bounds:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        value >= bounds.get("ge", -math.inf) and value > bounds.get("gt", -math.inf) and \
        value <= bounds.get("le", math.inf) and value < bounds.get("lt", math.inf)
    if not ok:
        integer = annotation is int or int in typing.get_args(annotation)
        raise ConfigError(f"{where}: expected {_range_text(bounds, integer)}, got {value!r}")


def check_fields(obj: Any, where: str) -> None:
    """Hold a built dataclass to its schema: each field's value coerced to its type (stored back, e.g. a list
    of two floats as a tuple) and checked against the field's :func:`setting` constraints; nested dataclasses
    are checked by their own ``validate``."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{where}.{f.name}"
        value = _coerce(getattr(obj, f.name), hints[f.name], key)
        _check_constraints(value, f.metadata, hints[f.name], key)
        object.__setattr__(obj, f.name, value)


class Section:
    """Base of a config section's dataclass: ``validate`` holds the object to its schema (:func:`check_fields`); a
    section with rules across fields overrides it, calling ``super().validate(where)`` first."""

    def validate(self, where: str) -> None:
        check_fields(self, where)


def check_known_keys(where: str, values: Mapping[str, Any], known) -> None:
    """A key of ``values`` outside ``known`` is a one-line error naming it (and listing the known ones)."""
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(known))})")


def build_dataclass(cls: Type[T], values: Mapping[str, Any], where: str) -> T:
    """``cls(**values)`` with unknown keys and mistyped values reported as ``ConfigError``."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    check_known_keys(where, values, fields)
    kwargs: Dict[str, Any] = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in values.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where}: {e}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(where)
    else:
        check_fields(obj, where)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (for logging / saving the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
