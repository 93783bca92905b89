"""The mixer registry: every sequence mixer a layer pattern can name, declared once.

An entry (:class:`MixerSpec`) holds a mixer's pattern symbol, its name (``kind``: the name in ``layer_plan``
and the key of its settings in ``HybridConfig`` / ``config.json``), its settings dataclass (with
``finalize(hidden_size, where)``), its module class (built as ``module(config, layer_idx)``, reading its
settings with ``config.mixer_args(kind)``) and what it caches while generating. The pattern parser, the
config, the generation cache, the weight init and the KV report all read it. The built-in mixers are
registered in :mod:`hybridlm.model.configuration`; :func:`register_mixer` adds another (before any config that
uses it is built or loaded), :func:`unregister_mixer` removes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from hybridlm.config.errors import ConfigError

# what a mixer keeps between generation steps
KV = "kv"                # a per-token cache that grows with the sequence (attention); counted as KV cache
RECURRENT = "recurrent"  # a constant-size state (cache.RecurrentCacheLayer: ``state`` and named conv states)
CACHES = (KV, RECURRENT, None)  # None: nothing cached (the mixer recomputes from the whole input)

CONFIGURED_SYMBOL = "M"  # the configured linear mixer (``mixer:``)
MLP_SYMBOL, MLP_KIND = "-", "mlp"  # the SwiGLU MLP sublayer: not a mixer
# names a mixer may not take: config keys of ``HybridConfig`` (extended by hybridlm.model.configuration)
RESERVED_KINDS = {MLP_KIND}


@dataclass(frozen=True)
class MixerSpec:
    kind: str
    symbol: str
    args: type
    module: type
    cache: Optional[str]
    # may be the configured linear mixer (``mixer: <kind>``, written ``M`` in a pattern); False for attention
    linear: bool = True
    # ``init(module, config)``: run by the model's weight init after the generic rules for linears, convs,
    # norms and ``reset_recurrent_parameters`` (HybridPreTrainedModel._init_weights). transformers passes a
    # module to that init only if it has parameters of its own (not only in its children), as Mamba2's A_log
    init: Optional[Callable[[Any, Any], None]] = None
    # write its settings into every saved config, used or not (the built-in mixers, whose sections every
    # config.json has always held); otherwise only configs that use or set it carry them
    save_unused: bool = False


_REGISTRY: Dict[str, MixerSpec] = {}


def register_mixer(kind: str, *, symbol: str, args: type, module: Optional[type] = None, cache: Optional[str],
                   linear: bool = True, init: Optional[Callable[[Any, Any], None]] = None,
                   save_unused: bool = False):
    """Register a mixer; returns its :class:`MixerSpec`. Without ``module``, a class decorator:
    ``@register_mixer("gla", symbol="L", args=GLAArgs, cache="recurrent")``.

    ``kind``: a lower-case identifier, its config key; ``symbol``: one character of the layer pattern;
    ``args``: a dataclass with defaults for every field and ``finalize(hidden_size, where)``; ``module``:
    ``module(config, layer_idx)``, ``forward(hidden, ctx)`` (ctx an InferenceContext or None) and, where
    ``cache`` is not None, ``cache_shapes()`` (what a static cache preallocates); ``cache``: ``"kv"``,
    ``"recurrent"`` or None."""
    if module is None:
        def decorate(cls):
            register_mixer(kind, symbol=symbol, args=args, module=cls, cache=cache, linear=linear, init=init,
                           save_unused=save_unused)
            return cls
        return decorate
    if not isinstance(kind, str) or not kind.isidentifier() or kind != kind.lower() or kind in RESERVED_KINDS:
        raise ValueError(f"register_mixer: kind {kind!r} must be a lower-case identifier other than "
                         f"{', '.join(sorted(RESERVED_KINDS))}")
    if kind in _REGISTRY:
        raise ValueError(f"register_mixer: {kind!r} is already registered")
    if not isinstance(symbol, str) or len(symbol) != 1 or symbol.isspace() or symbol in (CONFIGURED_SYMBOL, MLP_SYMBOL):
        raise ValueError(f"register_mixer: symbol {symbol!r} must be one character other than "
                         f"{CONFIGURED_SYMBOL!r} and {MLP_SYMBOL!r}")
    taken = kind_of_symbol(symbol)
    if taken is not None:
        raise ValueError(f"register_mixer: symbol {symbol!r} already stands for {taken!r}")
    if not dataclasses.is_dataclass(args) or not callable(getattr(args, "finalize", None)):
        raise TypeError(f"register_mixer: args of {kind!r} must be a dataclass with finalize(hidden_size, where)")
    if cache not in CACHES:
        raise ValueError(f"register_mixer: cache of {kind!r} must be one of {CACHES}, got {cache!r}")
    spec = MixerSpec(kind, symbol, args, module, cache, linear, init, save_unused)
    _REGISTRY[kind] = spec
    return spec


def unregister_mixer(kind: str) -> MixerSpec:
    """Remove a registered mixer (configs built with it keep working; new ones cannot name it)."""
    if kind not in _REGISTRY:
        raise KeyError(kind)
    return _REGISTRY.pop(kind)


def mixers() -> Tuple[MixerSpec, ...]:
    """Every registered mixer, in registration order."""
    return tuple(_REGISTRY.values())


def mixer_spec(kind: str) -> MixerSpec:
    """The entry of ``kind``; KeyError if none is registered."""
    return _REGISTRY[kind]


def is_mixer(kind: str) -> bool:
    return kind in _REGISTRY


def linear_kinds() -> List[str]:
    """The kinds ``mixer:`` (the ``M`` of a pattern) may name."""
    return [s.kind for s in _REGISTRY.values() if s.linear]


def kind_of_symbol(symbol: str) -> Optional[str]:
    return next((s.kind for s in _REGISTRY.values() if s.symbol == symbol), None)


def symbol_of(kind: str) -> str:
    """The pattern symbol of a mixer kind (``-`` for ``mlp``)."""
    return MLP_SYMBOL if kind == MLP_KIND else _REGISTRY[kind].symbol


def cache_of(kind: str) -> Optional[str]:
    """What a sublayer of ``kind`` caches while generating: ``"kv"``, ``"recurrent"`` or None (MLPs too)."""
    spec = _REGISTRY.get(kind)
    return None if spec is None else spec.cache


def pattern_symbols() -> str:
    """Every symbol a pattern may hold, for messages: ``* M G K S -`` with the built-in mixers."""
    return " ".join([s.symbol for s in _REGISTRY.values() if not s.linear] + [CONFIGURED_SYMBOL]
                    + [s.symbol for s in _REGISTRY.values() if s.linear] + [MLP_SYMBOL])


def check_kind(kind: str) -> None:
    """ConfigError unless ``mixer: kind`` names a registered linear mixer."""
    if kind not in linear_kinds():
        raise ConfigError(f"mixer: unknown mixer {kind!r}; expected one of {', '.join(linear_kinds())}")
