"""``HybridConfig``: the transformers config of a hybrid stack, plus typed per-mixer arguments.

Mixer settings live in nested dicts, one per registered mixer (``mla``, ``gdn``, ``kda``, ``mamba2`` and any
mixer added with :func:`~hybridlm.model.registry.register_mixer`), so the saved ``config.json`` stays plain JSON;
:meth:`HybridConfig.mixer_args` returns them as validated dataclasses. The built-in mixers, each with its settings
dataclass, register themselves in their files under :mod:`hybridlm.model.layers` (imported here).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from transformers import PretrainedConfig

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass, check_known_keys
from hybridlm.model import registry
# the built-in mixers register themselves on import; their settings dataclasses are named here as before
from hybridlm.model.layers import DeltaRuleArgs, Mamba2Args, MLAArgs
from hybridlm.model.pattern import parse_pattern, pattern_from_ratio
from hybridlm.model.registry import mixers, register_mixer
from hybridlm.model.runtime import RUNTIME_KEYS, RuntimeSettings, moved_key_error, runtime_settings


# Remote code is opt-in. By default a saved model is plain data (config.json, weights, tokenizer): it loads after
# `import hybridlm.model`, which registers the classes with transformers' Auto classes, and no `.py` in the folder
# ever runs. `write_remote_code` (``save_pretrained(..., remote_code=True)``, ``run.remote_code: true``) adds a
# one-line module importing the installed toolkit and an ``auto_map`` pointing the Auto classes at it, so that
# `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works without that import (plain lm-eval,
# vLLM-style loaders). Whoever loads a folder that way runs whatever `.py` it holds at that point.
AUTO_MODULE = "hybrid_lm_auto"
AUTO_MODULE_SOURCE = (
    '"""Loads the hybrid-lm-toolkit classes for transformers\' trust_remote_code (pip install hybrid-lm-toolkit)."""\n'
    "from hybridlm.model import HybridConfig, HybridForCausalLM  # noqa: F401\n")
AUTO_MAP = {"AutoConfig": f"{AUTO_MODULE}.HybridConfig", "AutoModelForCausalLM": f"{AUTO_MODULE}.HybridForCausalLM"}


# the --remote-code flag of every command that saves a model folder
REMOTE_CODE_HELP = ("also write hybrid_lm_auto.py and an auto_map, so the folder loads with trust_remote_code=True "
                    "without importing the toolkit; whoever loads it that way runs that .py "
                    "(only for sharing with people who do not use the toolkit)")


def write_remote_code(directory) -> None:
    """Opt-in: make a saved model directory loadable with ``trust_remote_code=True`` without importing the
    toolkit first (it must still be installed): writes ``hybrid_lm_auto.py`` and an ``auto_map`` in its
    ``config.json``. Only for sharing with people who do not use the toolkit; anyone who loads the folder with
    ``trust_remote_code=True`` runs the ``.py`` it contains."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing (save the model or config there first)")
    values = json.loads(config_file.read_text())
    values["auto_map"] = dict(AUTO_MAP)
    config_file.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    (directory / f"{AUTO_MODULE}.py").write_text(AUTO_MODULE_SOURCE)


DEFAULT_PATTERN = "*-M-M-M-"  # what ``HybridConfig()`` builds; YAML model files must say what they want


class HybridConfig(PretrainedConfig):
    model_type = "hybrid_lm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 128256,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        num_layers: Optional[int] = None,
        hybrid_override_pattern: Optional[str] = None,
        hybrid_attention_ratio: Optional[float] = None,
        mixer: str = "gdn",
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        pad_token_id: Optional[int] = None,
        **kwargs,
    ):
        """Each registered mixer's settings come as a keyword named after it (``mla={...}``, ``gdn={...}``).
        ``runtime`` (not saved): how this process runs the model (:class:`~hybridlm.model.runtime.RuntimeSettings`,
        a mapping of them, or None for the defaults); the model built from this config reads it."""
        given_args = {spec.kind: kwargs.pop(spec.kind, None) for spec in mixers()}
        kwargs.pop("num_hidden_layers", None)  # derived, written by to_dict for HF utilities
        kwargs.pop("layer_plan", None)
        # an auto_map (written by older versions, or by the remote-code opt-in) is a property of one saved
        # folder, not of the model: dropped here, so a re-save writes one only when asked to
        kwargs.pop("auto_map", None)
        for key in RUNTIME_KEYS:
            if key in kwargs:
                raise ConfigError(f"{key}: a runtime setting, not part of the model config; pass "
                                  f"runtime={{{key!r}: ...}} to HybridConfig or the model (hybridlm/model/runtime.py)")
        self._runtime = runtime_settings(kwargs.pop("runtime", None))
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.mixer = mixer
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        for name in ("vocab_size", "hidden_size", "intermediate_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(rms_norm_eps, (int, float)) or not rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps: must be a positive number, got {rms_norm_eps!r}")
        if hybrid_override_pattern is None and hybrid_attention_ratio is None and num_layers is None:
            # transformers builds ``HybridConfig()`` to diff against when saving: it must be a valid default
            hybrid_override_pattern = DEFAULT_PATTERN
        if hybrid_override_pattern is None:
            if hybrid_attention_ratio is None or num_layers is None:
                raise ConfigError("hybrid_override_pattern: missing; give a pattern such as '*-M-M-M-' "
                                  "or num_layers with hybrid_attention_ratio")
            if not 0.0 <= hybrid_attention_ratio <= 1.0:
                raise ConfigError(f"hybrid_attention_ratio: {hybrid_attention_ratio} is not in [0, 1]")
            hybrid_override_pattern = pattern_from_ratio(num_layers, hybrid_attention_ratio)
        self.layer_plan: List[str] = parse_pattern(hybrid_override_pattern, num_layers, mixer, hybrid_attention_ratio)
        self.hybrid_override_pattern = hybrid_override_pattern
        self.hybrid_attention_ratio = hybrid_attention_ratio
        self.num_layers = len(self.layer_plan)
        self._mixer_args = {}
        for spec in mixers():
            name, given = spec.kind, given_args[spec.kind]
            args = build_dataclass(spec.args, given or {}, name)
            try:
                args.finalize(hidden_size, name)
            except ConfigError:
                if name in self.layer_plan:  # defaults of a mixer the stack does not use may not fit it
                    raise
            self._mixer_args[name] = args
            if spec.save_unused or given is not None or name in self.layer_plan:
                setattr(self, name, dataclasses.asdict(args))
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' loading path (``from_pretrained``): a ``config.json`` written before the runtime settings
        left the model config holds how that run executed (``backend``, ``fuse_projections``, ...); ignored, so
        such an export loads with the defaults, or with ``runtime=...`` given here."""
        config_dict = {k: v for k, v in config_dict.items() if k not in RUNTIME_KEYS}
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_user_dict(cls, values: dict, where: str = "model") -> "HybridConfig":
        """Build from a YAML model section; an unknown key is an error rather than a silent extra attribute, and a
        runtime setting (``backend``, ``fuse_projections``, ...) names the ``runtime`` section it belongs in."""
        for key in values:
            moved = moved_key_error(where, key)
            if moved:
                raise ConfigError(moved)
        check_known_keys(where, values, (set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"})
                         | {spec.kind for spec in mixers()})
        if values.get("hybrid_override_pattern") is None and values.get("hybrid_attention_ratio") is None:
            raise ConfigError(f"{where}.hybrid_override_pattern: missing; give a pattern such as '*-M-M-M-' "
                              "or num_layers with hybrid_attention_ratio")
        return cls(**values)

    def save_pretrained(self, save_directory, *args, remote_code: bool = False, **kwargs):
        """``remote_code=True``: also :func:`write_remote_code` (see there what it implies)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if remote_code:
            write_remote_code(save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """A no-op: ``import hybridlm.model`` registers the class with the Auto classes, and transformers' own
        registration (done when a folder is loaded with ``trust_remote_code=True``) would copy this module's
        source into every later save."""

    @property
    def num_hidden_layers(self) -> int:  # what transformers' generic utilities read
        return self.num_layers

    @property
    def runtime(self) -> RuntimeSettings:
        """How this process runs the model (not saved). The model's modules read this one object when they run;
        change it with ``model.set_runtime(...)``."""
        return self._runtime

    @runtime.setter
    def runtime(self, value) -> None:  # transformers' from_pretrained(..., runtime=...) sets it here
        self._runtime = runtime_settings(value)

    def mixer_args(self, name: str):
        """The settings dataclass of mixer ``name`` (KeyError for a name no registered mixer has)."""
        return self._mixer_args[name]

    def to_dict(self):
        out = super().to_dict()
        out.pop("_mixer_args", None)
        out.pop("layer_plan", None)
        out.pop("auto_map", None)  # only write_remote_code writes one
        out.pop("_runtime", None)  # how this process runs the model, not the model
        return out


__all__ = ["HybridConfig", "write_remote_code", "MLAArgs", "DeltaRuleArgs", "Mamba2Args", "register_mixer"]
registry.RESERVED_KINDS.update(set(inspect.signature(HybridConfig.__init__).parameters) - {"self", "kwargs"},
                               RUNTIME_KEYS, {"runtime"})


def resolve_model_config(model_section: Dict[str, Any], meta: Dict[str, Any], data_path: Path) -> HybridConfig:
    """The model config, with ``vocab_size: auto`` (or absent) taken from the tokenizer of the data."""
    values = dict(model_section)
    tok = meta.get("tokenizer", {})
    data_vocab = int(tok.get("vocab_size", 0))
    if values.get("vocab_size", "auto") == "auto":
        values["vocab_size"] = data_vocab
    elif int(values["vocab_size"]) < data_vocab:
        raise ConfigError(f"model.vocab_size: {values['vocab_size']} is smaller than the tokenizer vocabulary "
                          f"({data_vocab}) of the data in {data_path}")
    values.setdefault("eos_token_id", tok.get("eos_id"))
    values.setdefault("bos_token_id", tok.get("bos_id"))
    return HybridConfig.from_user_dict(values)
