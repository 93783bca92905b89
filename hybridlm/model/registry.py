"""The mixer registry: every sequence mixer a layer pattern can name, declared once.

An entry (:class:`MixerSpec`) holds a mixer's pattern symbol, its name (``kind``: the name in ``layer_plan``
and the key of its settings in ``HybridConfig`` / ``config.json``), its settings dataclass (with
``finalize(hidden_size, where)``), its module class (built from its own settings:
``module(args, hidden_size, layer_idx=..., runtime=...)``, :meth:`MixerSpec.build`), what it caches while
generating, its costs (:class:`MixerCosts`: FLOPs, cache and state sizes, activation widths), and where its
upcycling from a Llama attention and its vLLM twin live (names of objects in the stages above the library, loaded
by whoever uses them). The pattern parser, the config, the model, the generation cache, the weight init, the KV
report (:mod:`hybridlm.kv_report`), ``upcycle plan``, ``upcycle init``, the vLLM model and the benchmarks' FLOP
count all read it. Each built-in mixer registers itself at the end of its own file in
:mod:`hybridlm.model.layers` (settings, module, costs, init and entry together); :func:`register_mixer` adds
another (before any config that uses it is built or loaded), :func:`unregister_mixer` removes it.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from hybridlm.config.errors import ConfigError

# what a mixer keeps between generation steps
LATENT = "latent"        # a per-token cache that grows with the sequence (cache.LatentCacheLayer: MLA's latent and
                         # RoPE key); the attention sublayers, counted as KV cache
RECURRENT = "recurrent"  # a constant-size state (cache.RecurrentCacheLayer: ``state`` and named conv states)
CACHES = (LATENT, RECURRENT, None)  # None: nothing cached (the mixer recomputes from the whole input)
OLD_CACHE_NAMES = {"kv": LATENT}  # accepted by register_mixer until the next release, with a FutureWarning

CONFIGURED_SYMBOL = "M"  # the configured linear mixer (``mixer:``)
MLP_SYMBOL, MLP_KIND = "-", "mlp"  # the SwiGLU MLP sublayer: not a mixer
# names a mixer may not take: config keys of ``HybridConfig`` (extended by hybridlm.model.configuration)
RESERVED_KINDS = {MLP_KIND}


def _none(args) -> int:
    return 0


def check_positive(args, where: str, names) -> None:
    """Each of ``names`` that is set on settings ``args`` must be a positive int (0 or a negative size would crash,
    or be replaced by a default, deep inside a layer)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{where}.{name}: must be a positive integer, got {value!r}")


def check_divides(where: str, what: str, n: int, total_name: str, total: int) -> None:
    """ConfigError unless ``n`` (``what``) divides ``total`` (``total_name``)."""
    if n <= 0 or total % n:
        raise ConfigError(f"{where}: {what} {n} does not divide {total_name} {total}")


def load_object(path: str) -> Any:
    """The object a ``"package.module:name"`` string names (imported on use: an entry may name an object of a
    layer above the library, as an entry point does)."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"{path!r}: expected 'package.module:name'")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class MixerCosts:
    """What the planners (``upcycle plan``, the KV report, the benchmarks' FLOP count) know of a mixer. Each
    function takes the mixer's finalized settings (``config.mixer_args(kind)``)."""
    # forward FLOPs per token beyond the weight multiplies, ``flops(args, seq_len)``: attention's scores and
    # weighted sums over the ``seq_len`` context, a chunked recurrence's intra-chunk and state terms. The weights'
    # 2 FLOPs per parameter and token are counted from the built model; training costs 3x the forward
    flops: Callable[[Any, int], float]
    # values cached per token and sequence while generating (a latent / KV cache); 0 for a fixed-size state
    cache_per_token: Callable[[Any], int] = _none
    # values of the fixed-size generation state per sequence (recurrent state and conv tails); 0 for none
    state_per_sequence: Callable[[Any], int] = _none
    # values per token the backward keeps of the mixer (its pre-norm not included), bf16 values with an fp32
    # tensor counted as two; None: no activation model (``upcycle plan`` then refuses a stage training it)
    activations: Optional[Callable[[Any], float]] = None


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
    costs: Optional[MixerCosts] = None
    # the name messages and reports print (``MLA``, ``Mamba2``); the kind by default
    title: str = ""
    # ``upcycle init`` from a Llama attention: an object with ``student_args(teacher_shapes) -> settings dict`` and
    # ``init(mixer, attn)`` (:class:`upcycle.init_linear.FromAttention`), or its ``"module:name"`` (loaded by the stage);
    # None: the mixer is not built from attention
    from_attention: Union[str, Any, None] = None
    # vLLM serving (hybridlm/serve): ``"module:name"`` of the served layer, ``layer(config, vllm_config, prefix)``
    # (hybridlm/serve/model.py, imports vLLM), and of its weight mapping, ``weights(name, tensor, config) ->
    # [(served name, tensor)]`` with ``name`` after ``mixer.`` (hybridlm/serve/mapping.py, no vLLM; None: the
    # export's names and layout as they are); no ``serve_layer``: vLLM does not serve the mixer
    serve_layer: Optional[str] = None
    serve_weights: Optional[str] = None

    @property
    def name(self) -> str:
        return self.title or self.kind

    def build(self, config, layer_idx: int = 0):
        """The mixer of sublayer ``layer_idx`` of ``config`` (a ``HybridConfig``), from its own settings, the model
        width and the model's runtime settings."""
        return self.module(config.mixer_args(self.kind), config.hidden_size, layer_idx=layer_idx,
                           runtime=config.runtime)


_REGISTRY: Dict[str, MixerSpec] = {}


def register_mixer(kind: str, *, symbol: str, args: type, module: Optional[type] = None, cache: Optional[str],
                   linear: bool = True, init: Optional[Callable[[Any, Any], None]] = None,
                   save_unused: bool = False, costs: Optional[MixerCosts] = None, title: str = "",
                   from_attention: Union[str, Any, None] = None, serve_layer: Optional[str] = None,
                   serve_weights: Optional[str] = None):
    """Register a mixer; returns its :class:`MixerSpec`. Without ``module``, a class decorator:
    ``@register_mixer("gla", symbol="L", args=GLAArgs, cache="recurrent", costs=GLA_COSTS)``.

    ``kind``: a lower-case identifier, its config key; ``symbol``: one character of the layer pattern;
    ``args``: a dataclass with defaults for every field and ``finalize(hidden_size, where)``; ``module``:
    ``module(args, hidden_size, layer_idx=0, runtime=None)`` (``args`` finalized; ``runtime`` the model's
    :class:`~hybridlm.model.runtime.RuntimeSettings`, read when it runs), ``forward(hidden, ctx)`` (ctx an
    InferenceContext or None) and, where ``cache`` is not None, ``cache_shapes()`` (what a static cache
    preallocates); ``cache``: ``"latent"``, ``"recurrent"`` or None; ``costs``: a :class:`MixerCosts` (without it
    the planners refuse the mixer); ``title``: its name in reports; ``from_attention``, ``serve_layer``,
    ``serve_weights``: see :class:`MixerSpec`."""
    if module is None:
        def decorate(cls):
            register_mixer(kind, symbol=symbol, args=args, module=cls, cache=cache, linear=linear, init=init,
                           save_unused=save_unused, costs=costs, title=title, from_attention=from_attention,
                           serve_layer=serve_layer, serve_weights=serve_weights)
            return cls
        return decorate
    if cache in OLD_CACHE_NAMES:
        warnings.warn(f"register_mixer: cache={cache!r} is now cache={OLD_CACHE_NAMES[cache]!r}; {cache!r} is "
                      f"accepted until the next release", FutureWarning, stacklevel=2)
        cache = OLD_CACHE_NAMES[cache]
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
    if not _built_from_its_settings(module):
        raise TypeError(f"register_mixer: module of {kind!r} must be built as module(args, hidden_size, layer_idx=0, "
                        f"runtime=None) (its own settings, not the whole config); {module.__name__} takes "
                        f"{inspect.signature(module)}")
    if costs is not None and not isinstance(costs, MixerCosts):
        raise TypeError(f"register_mixer: costs of {kind!r} must be a MixerCosts, got {type(costs).__name__}")
    if not (from_attention is None or isinstance(from_attention, str)
            or all(callable(getattr(from_attention, f, None)) for f in ("student_args", "init"))):
        raise TypeError(f"register_mixer: from_attention of {kind!r} must have student_args(shapes) and "
                        f"init(mixer, attn), or be the 'package.module:name' of such an object")
    for name, path in (("serve_layer", serve_layer), ("serve_weights", serve_weights)):
        if path is not None and (not isinstance(path, str) or ":" not in path):
            raise TypeError(f"register_mixer: {name} of {kind!r} must be a 'package.module:name' string, got {path!r}")
    spec = MixerSpec(kind, symbol, args, module, cache, linear=linear, init=init, save_unused=save_unused,
                     costs=costs, title=title, from_attention=from_attention, serve_layer=serve_layer,
                     serve_weights=serve_weights)
    _REGISTRY[kind] = spec
    return spec


def _built_from_its_settings(module) -> bool:
    """Whether ``module(args, hidden_size, layer_idx=..., runtime=...)`` binds to the class's constructor."""
    try:
        inspect.signature(module).bind(None, 0, layer_idx=0, runtime=None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): left to the first build
        return True
    return True


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
    """What a sublayer of ``kind`` caches while generating: ``"latent"``, ``"recurrent"`` or None (MLPs too)."""
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


def costs_of(kind: str) -> MixerCosts:
    """The :class:`MixerCosts` of a registered mixer; ConfigError for an unknown kind or one registered without."""
    spec = _REGISTRY.get(kind)
    if spec is None:
        raise ConfigError(f"unknown mixer {kind!r}; registered: {', '.join(_REGISTRY)}")
    if spec.costs is None:
        raise ConfigError(f"mixer {kind!r}: its registry entry gives no costs (register_mixer(..., "
                          f"costs=MixerCosts(...)), hybridlm/model/registry.py)")
    return spec.costs
