"""Two-layer YAML configs (a model file + an experiment file that overrides it) plus CLI overrides.

An experiment file names its model file relative to itself and may override any model key:

    model:
      from: ../models/gdn_300m.yaml
      backend: torch            # overrides the model file
    optim: {lr: 2.0e-4}

or simply ``model: ../models/gdn_300m.yaml``. A plain model file works as ``--config`` too (then it is
the ``model`` section of an otherwise default experiment). Command-line overrides are dotted
``section.key=value`` pairs whose values are parsed as YAML (``optim.lr=3e-4 model.mixer=kda``).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional

import yaml

from hybridlm.config.errors import ConfigError


def read_yaml(path: Path) -> Dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(item: str) -> Dict[str, Any]:
    """``a.b.c=value`` -> ``{"a": {"b": {"c": value}}}`` with the value parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            value = float(value) if any(c in value.lower() for c in ".e") and value.lower() not in ("inf", "nan") else value
        except ValueError:
            pass
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _resolve_model(section: Any, base_dir: Path, seen: tuple = ()) -> Dict[str, Any]:
    if isinstance(section, str):
        section = {"from": section}
    if not isinstance(section, Mapping):
        raise ConfigError(f"model: expected a model file path or a mapping, got {type(section).__name__}")
    section = dict(section)
    source = section.pop("from", None)
    if source is None:
        return section
    path = (base_dir / source).resolve()
    if path in seen:
        raise ConfigError(f"model.from: {path} includes itself")
    base = read_yaml(path)
    return deep_merge(_resolve_model(base, path.parent, seen + (path,)), section)


def load_config(path: Optional[str], overrides: Iterable[str] = (),
                sections: Iterable[str] = ("model", "data", "optim", "run")) -> Dict[str, Any]:
    """Resolve an experiment (or model) file and overrides into ``{section: dict}``."""
    sections = tuple(sections)
    raw: Dict[str, Any] = {}
    base_dir = Path.cwd()
    if path is not None:
        raw = read_yaml(Path(path))
        base_dir = Path(path).resolve().parent
        if not any(k in sections for k in raw):  # a bare model file
            raw = {"model": raw}
    for item in overrides:
        raw = deep_merge(raw, parse_override(item))
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"{path or 'config'}: unknown section {unknown[0]!r} (known sections: {', '.join(sections)})")
    out = {name: raw.get(name) or {} for name in sections}
    if "model" not in sections:
        return out
    out["model"] = _resolve_model(raw.get("model") or {}, base_dir)
    # CLI overrides of model keys must win over the model file as well
    for item in overrides:
        parsed = parse_override(item)
        if "model" in parsed and isinstance(parsed["model"], Mapping):
            out["model"] = deep_merge(out["model"], {k: v for k, v in parsed["model"].items() if k != "from"})
    return out
