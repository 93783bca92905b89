"""KV-cache size of an MLA + linear-mixer hybrid against its Llama teacher (README, "Upcycling a Llama").

Values cached per token per decoder layer:

* Llama (GQA) attention: ``2 * n_kv * d_h`` (a key and a value per KV head);
* a hybrid layer: its mixer's ``cache_per_token`` in the mixer registry (:class:`hybridlm.model.registry.MixerCosts`):
  MLA's ``kv_lora_rank + qk_rope_head_dim`` (the compressed joint KV latent plus the one shared decoupled RoPE
  key); 0 for a linear mixer, whose recurrent state has a constant size (its ``state_per_sequence``, reported
  beside), independent of the sequence length.

``ratio = sum over the hybrid's layers of their values per token / (L * 2 * n_kv * d_h)`` and
``compression = 1 / ratio``. Check values (published): Llama-3.2-1B with 8 MLA layers at kv_lora_rank 128,
qk_rope_head_dim 32 -> 7.81% = 12.8x.

The three public teachers' architecture shapes ship as ``configs/llama/*.json``; ``load_teacher_config``
reads those, any HF ``config.json`` or a model directory holding one.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import hybridlm.model.configuration  # noqa: F401  (registers the built-in mixers)
from hybridlm.config.errors import ConfigError
from hybridlm.config.layers import validate_layers
from hybridlm.model.registry import LATENT, cache_of, costs_of, is_mixer, mixer_spec

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "llama"
PUBLIC_TEACHERS = {"llama-3.2-1b": "llama-3.2-1b.json", "llama-3.2-3b": "llama-3.2-3b.json",
                   "llama-3.1-8b": "llama-3.1-8b.json"}
_REQUIRED = ("num_hidden_layers", "num_attention_heads", "hidden_size")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def teacher_shapes(teacher_cfg: Union[Mapping[str, Any], Any]) -> Dict[str, int]:
    """``L, n_h, n_kv, d_h, hidden`` of a LlamaConfig or a dict (``head_dim`` defaults to hidden / heads and
    ``num_key_value_heads`` to the query heads, as in transformers)."""
    get = teacher_cfg.get if isinstance(teacher_cfg, Mapping) else (lambda k, d=None: getattr(teacher_cfg, k, d))
    for key in _REQUIRED:
        v = get(key)
        if not _is_int(v) or v <= 0:
            raise ConfigError(f"teacher config: {key} must be a positive integer, got {v!r}")
    L, n_h, d = get("num_hidden_layers"), get("num_attention_heads"), get("hidden_size")
    n_kv = get("num_key_value_heads") or n_h
    d_h = get("head_dim") or d // n_h
    if not _is_int(n_kv) or n_kv <= 0 or n_h % n_kv:
        raise ConfigError(f"teacher config: num_key_value_heads must be a positive divisor of "
                          f"num_attention_heads {n_h}, got {n_kv!r}")
    if not _is_int(d_h) or d_h <= 0:
        raise ConfigError(f"teacher config: head_dim must be a positive integer, got {d_h!r}")
    return dict(L=L, n_h=n_h, n_kv=n_kv, d_h=d_h, hidden=d)


def _check_mla_layers(mla_layers: Iterable[int], L: int) -> List[int]:
    return validate_layers(mla_layers, None, L, field="mla_layers", what="teacher")


def kv_layers(layer_kinds: Sequence[Optional[str]]) -> List[int]:
    """Indices of the layers whose mixer keeps a per-token cache (``cache="latent"`` in the mixer registry,
    hybridlm/model/registry.py), of one mixer kind per teacher layer (``mla``, ``gdn``, ...)."""
    return [i for i, kind in enumerate(layer_kinds) if kind is not None and cache_of(kind) == LATENT]


ATTENTION_KIND = "mla"  # the mixer of ``mla_layers`` when no ``layer_kinds`` are given


def _settings(kind: str, given: Mapping[str, Any], hidden: int, fields: Mapping[str, int]):
    """The settings of ``kind``: ``given[kind]`` or its registered defaults finalized at the teacher's width, with
    ``fields`` set where the settings have fields of those names."""
    args = copy.deepcopy(given[kind]) if kind in given else mixer_spec(kind).args()
    for name, value in fields.items():
        if hasattr(args, name):
            setattr(args, name, value)
    if kind not in given:
        try:
            args.finalize(hidden, kind)
        except ConfigError as e:
            raise ConfigError(f"{e} (the defaults of mixer {kind!r} at the teacher's width {hidden}; pass its "
                              f"settings as mixer_args)") from None
    return args


def kv_report(teacher_cfg, mla_layers: Iterable[int], kv_lora_rank: int, qk_rope_head_dim: int,
              bytes_per_value: int = 2, layer_kinds: Optional[Sequence[str]] = None,
              linear_mixer: Optional[str] = None, mixer_args: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """KV-cache accounting of the hybrid whose MLA layers are ``mla_layers`` and whose other layers are
    ``linear_mixer`` (None: a linear mixer not named, caching nothing per token, its state not counted), or whose
    layers are the kinds ``layer_kinds`` names, one per teacher layer (then ``mla_layers`` must be
    :func:`kv_layers` of them). ``mixer_args``: the student's settings per kind (``config.mixer_args(kind)``); a
    kind not given gets its registered defaults at the teacher's width. ``kv_lora_rank`` and
    ``qk_rope_head_dim`` set the fields of those names (MLA's).

    Returns a dict: ``num_layers``, ``mla_layers``, ``kv_lora_rank``, ``qk_rope_head_dim``,
    ``teacher_values_per_token``, ``hybrid_values_per_token``, ``ratio`` (hybrid / teacher), ``compression``
    (teacher / hybrid; None when the hybrid caches nothing), ``teacher_bytes_per_token``,
    ``hybrid_bytes_per_token``, ``bytes_per_value``, ``hybrid_state_values`` (the fixed-size state per sequence;
    None when a layer's mixer is not named), ``mixers`` (one ``{kind, title, layers, values_per_token,
    state_values}`` a kind, per layer) and ``per_layer`` (one ``{layer, kind, teacher_values, hybrid_values,
    state_values}`` a layer).
    """
    s = teacher_shapes(teacher_cfg)
    for name, v, lo in (("kv_lora_rank", kv_lora_rank, 1), ("qk_rope_head_dim", qk_rope_head_dim, 0),
                        ("bytes_per_value", bytes_per_value, 1)):
        if not _is_int(v) or v < lo:
            raise ConfigError(f"{name}: expected an integer >= {lo}, got {v!r}")
    L = s["L"]
    mla = _check_mla_layers(mla_layers, L)
    if layer_kinds is not None:
        kinds = list(layer_kinds)
    else:
        kinds = [ATTENTION_KIND if i in set(mla) else linear_mixer for i in range(L)]
    unknown = [k for k in kinds if k is not None and not is_mixer(k)]
    if unknown:
        raise ConfigError(f"layer_kinds: unknown mixer {unknown[0]!r}")
    if len(kinds) != L or kv_layers(kinds) != mla:
        raise ConfigError(f"layer_kinds: expected {L} mixer kinds whose KV-cache layers are {mla}, got {kinds!r}")
    fields = {"kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim}
    mixers: Dict[Optional[str], Dict[str, Any]] = {}
    for kind in kinds:
        if kind in mixers:
            mixers[kind]["layers"] += 1
        elif kind is None:
            mixers[kind] = dict(kind=None, title="linear", layers=1, values_per_token=0, state_values=None)
        else:
            args, costs = _settings(kind, mixer_args or {}, s["hidden"], fields), costs_of(kind)
            mixers[kind] = dict(kind=kind, title=mixer_spec(kind).name, layers=1,
                                values_per_token=int(costs.cache_per_token(args)),
                                state_values=int(costs.state_per_sequence(args)))
    llama_layer = 2 * s["n_kv"] * s["d_h"]
    per_layer = [dict(layer=i, kind=kind, teacher_values=llama_layer, hybrid_values=mixers[kind]["values_per_token"],
                      state_values=mixers[kind]["state_values"]) for i, kind in enumerate(kinds)]
    teacher = L * llama_layer
    hybrid = sum(r["hybrid_values"] for r in per_layer)
    states = [r["state_values"] for r in per_layer]
    return dict(
        num_layers=L, num_key_value_heads=s["n_kv"], head_dim=s["d_h"],
        mla_layers=mla, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
        teacher_values_per_token=teacher, hybrid_values_per_token=hybrid,
        ratio=hybrid / teacher, compression=(teacher / hybrid) if hybrid else None,
        bytes_per_value=bytes_per_value,
        teacher_bytes_per_token=teacher * bytes_per_value, hybrid_bytes_per_token=hybrid * bytes_per_value,
        hybrid_state_values=None if None in states else sum(states),
        mixers=list(mixers.values()), per_layer=per_layer,
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def format_kv_report(report: Mapping[str, Any]) -> str:
    """A short human-readable table of a ``kv_report`` result."""
    comp = report["compression"]
    comp_s = f"{comp:.1f}x" if comp is not None else "inf (no KV cache)"
    mixers = report["mixers"]
    rows = [("", "values/token", "bytes/token"),
            ("teacher", f"{report['teacher_values_per_token']:,}", _fmt_bytes(report["teacher_bytes_per_token"])),
            ("hybrid", f"{report['hybrid_values_per_token']:,}", _fmt_bytes(report["hybrid_bytes_per_token"]))]
    w = [max(len(r[c]) for r in rows) for c in range(3)]
    n_kv, d_h = report["num_key_value_heads"], report["head_dim"]
    counts = " + ".join(f"{m['layers']} {m['title']}" for m in mixers)
    widths = ", ".join(f"{m['title']} {m['values_per_token']:,}" for m in mixers)
    lines = [f"KV cache: {counts} of {report['num_layers']} layers (values per token and layer: {widths}; "
             f"teacher 2 x {n_kv} KV heads x {d_h} = {2 * n_kv * d_h:,})"]
    lines += ["  " + "  ".join(r[c].ljust(w[c]) if c == 0 else r[c].rjust(w[c]) for c in range(3)) for r in rows]
    lines.append(f"  ratio {100 * report['ratio']:.2f}%  compression {comp_s}  "
                 f"({report['bytes_per_value']} bytes/value)")
    lines.append(f"  MLA layers: {report['mla_layers']}")
    stateful = [m for m in mixers if m["state_values"] is None or m["state_values"] > 0]
    if stateful:
        parts = [f"{m['layers']} {m['title']} layers not counted (mixer not named)" if m["state_values"] is None else
                 f"{m['title']} {m['layers']} x {m['state_values']:,}" for m in stateful]
        total = report["hybrid_state_values"]
        lines.append(f"  fixed-size state per sequence: {', '.join(parts)}"
                     + (f" = {total:,} values" if total is not None else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------- teacher configs
ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings")


def resolve_teacher_config(path_or_dir: Union[str, Path]) -> Path:
    """The config.json for a file, a model directory, or a public teacher name (``llama-3.2-1b``...)."""
    name = str(path_or_dir)
    if name.lower() in PUBLIC_TEACHERS:
        return CONFIG_DIR / PUBLIC_TEACHERS[name.lower()]
    p = Path(name).expanduser()
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"teacher config {name!r}: expected a config.json file or a model directory holding one "
                          f"(or one of {sorted(PUBLIC_TEACHERS)})")
    return f


def load_teacher_config(path_or_dir: Union[str, Path]):
    """A transformers ``LlamaConfig`` from a config.json, a model directory or a public teacher name."""
    from transformers import LlamaConfig

    f = resolve_teacher_config(path_or_dir)
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{f}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{f}: expected a JSON object, got {type(data).__name__}")
    if data.get("model_type", "llama") != "llama":
        raise ConfigError(f"{f}: model_type must be 'llama', got {data.get('model_type')!r}")
    for key in _REQUIRED:
        if key not in data:
            raise ConfigError(f"{f}: missing field {key!r}")
    try:
        teacher_shapes(data)
    except ConfigError as e:
        raise ConfigError(f"{f}: {e}") from None
    fields = {k: v for k, v in data.items() if k != "model_type"}
    return LlamaConfig(**fields)


if __name__ == "__main__":  # pragma: no cover - handy check: python -m hybridlm.kv_report CONFIG 0,4,8 128 32
    cfg = load_teacher_config(sys.argv[1])
    layers = [int(x) for x in sys.argv[2].split(",") if x]
    print(format_kv_report(kv_report(cfg, layers, int(sys.argv[3]), int(sys.argv[4]))))
