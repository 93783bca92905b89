"""SMART layer selection: which Llama layers become MLA in the MLA + Mamba2 hybrid (README, "Upcycling a Llama").

Inputs are KL divergences measured on the pure-Mamba2 student after ILD: ``kl_all`` = KL(teacher ||
all-Mamba2) and, per layer ``i``, ``kl_i`` = KL with only layer ``i`` swapped to its MLA (ILD) layer.
The sensitivity ``s_i = kl_all - kl_i`` is how much that one MLA layer helps (larger = more useful).

Selection rule for ``N`` MLA layers out of ``L`` (``N >= 2``; ``N == 1`` is ``[0]``, ``N == 0`` is ``[]``):

1. The first layer is ``0``.
2. The last layer is ``L - 2`` or ``L - 1``, whichever has the larger sensitivity (a tie goes to
   ``L - 2``). An end that cannot hold ``N`` layers with gaps of at least 1 (``end < N - 1``, or the
   end is layer 0 itself) is skipped, so ``N == L`` ends at ``L - 1`` and selects every layer.
3. With ``D = last - first``, every gap between consecutive chosen layers is ``floor(D / (N - 1))``
   or ``ceil(D / (N - 1))``. Gaps sum to ``D``, so exactly ``D mod (N - 1)`` of them are the ceiling
   (when ``N - 1`` divides ``D`` all gaps are equal and the selection is unique).
4. Among all selections satisfying 1-3, take the one with the largest summed sensitivity, found by a
   dynamic program over (position in the chain, layer). Ties go to the lexicographically smallest
   selection (earlier layers first), so the result is deterministic.

Check against the published Llama-3.2-1B picks (L = 16, both with the end at 14 = L - 2):
N = 8: D = 14, gaps all 14 / 7 = 2 -> ``[0, 2, 4, 6, 8, 10, 12, 14]`` (unique once the end is 14);
N = 4: D = 14, gaps in {4, 5} with two 5s -> one of ``[0, 4, 9, 14]``, ``[0, 5, 9, 14]``,
``[0, 5, 10, 14]``; the published ``[0, 5, 10, 14]`` is the one where ``s_5 + s_10`` is largest.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from hybridlm.config.errors import ConfigError
from hybridlm.config.layers import validate_layers

KLValues = Union[Sequence[float], Mapping[int, float]]


def _finite(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ConfigError(f"{name}: expected a finite number, got {v!r}")
    return float(v)


def _kl_list(kl_per_layer: KLValues) -> List[float]:
    """Per-layer KL values as a list indexed by layer (a dict must hold keys 0..L-1)."""
    if isinstance(kl_per_layer, Mapping):
        try:
            keys = sorted(int(k) for k in kl_per_layer)
        except (TypeError, ValueError):
            raise ConfigError(f"kl_per_layer: keys must be layer indices, got {sorted(map(str, kl_per_layer))}") from None
        if keys != list(range(len(keys))):
            raise ConfigError(f"kl_per_layer: expected one value for every layer 0..{len(keys) - 1}, got layers {keys}")
        values = [kl_per_layer[k] if k in kl_per_layer else kl_per_layer[str(k)] for k in keys]  # type: ignore[index]
    elif isinstance(kl_per_layer, (str, bytes)) or not isinstance(kl_per_layer, Sequence):
        raise ConfigError(f"kl_per_layer: expected a list of per-layer KL values, got {type(kl_per_layer).__name__}")
    else:
        values = list(kl_per_layer)
    if not values:
        raise ConfigError("kl_per_layer: expected at least one layer")
    return [_finite(f"kl_per_layer[{i}]", v) for i, v in enumerate(values)]


def sensitivities(kl_all: float, kl_per_layer: KLValues) -> List[float]:
    """``s_i = kl_all - kl_i`` for every layer."""
    base = _finite("kl_all", kl_all)
    return [base - kl for kl in _kl_list(kl_per_layer)]


def _check_n(n_mla: Any, L: int) -> int:
    if isinstance(n_mla, bool) or not isinstance(n_mla, int) or not 0 <= n_mla <= L:
        raise ConfigError(f"n_mla: expected an integer between 0 and the {L} layers, got {n_mla!r}")
    return n_mla


def selection_rule(sensitivity: Sequence[float], n_mla: int) -> Dict[str, int]:
    """The constraints of the rule for these sensitivities: ``first``, ``last``, ``gap_lo``, ``gap_hi``
    (``n_hi``: how many gaps are ``gap_hi``). For ``n_mla < 2`` the gaps are 0."""
    s = [_finite(f"sensitivity[{i}]", v) for i, v in enumerate(sensitivity)]
    L = len(s)
    if L == 0:
        raise ConfigError("sensitivity: expected at least one layer")
    n = _check_n(n_mla, L)
    if n < 2:
        return dict(first=0, last=0, gap_lo=0, gap_hi=0, n_hi=0)
    ends = [e for e in (L - 2, L - 1) if e >= 1 and e >= n - 1]
    last = max(ends, key=lambda e: (s[e], -e))  # larger sensitivity; a tie goes to the earlier layer (L - 2)
    gaps = n - 1
    lo, rem = divmod(last, gaps)
    return dict(first=0, last=last, gap_lo=lo, gap_hi=lo + (1 if rem else 0), n_hi=rem)


def is_valid_selection(chosen: Sequence[int], sensitivity: Sequence[float], n_mla: int) -> bool:
    """Whether ``chosen`` (sorted layer indices) satisfies the selection rule."""
    rule = selection_rule(sensitivity, n_mla)
    chosen = list(chosen)
    if len(chosen) != n_mla:
        return False
    if n_mla == 0:
        return True
    if chosen[0] != rule["first"] or (n_mla >= 2 and chosen[-1] != rule["last"]):
        return False
    return all(b - a in (rule["gap_lo"], rule["gap_hi"]) for a, b in zip(chosen, chosen[1:]))


def select_layers(sensitivity: Optional[Sequence[float]], n_mla: int, mla_layers: Optional[Sequence[int]] = None,
                  num_layers: Optional[int] = None) -> List[int]:
    """The ``n_mla`` layers to make MLA, sorted.

    With ``mla_layers`` given, that explicit list is validated (in range, unique, ``n_mla`` long) and
    returned sorted; ``sensitivity`` may then be None if ``num_layers`` is given. Otherwise the
    selection rule of this module's docstring is applied: first layer 0, last ``L - 2`` or ``L - 1``
    by sensitivity, gaps floor/ceil of the even spacing, maximum summed sensitivity (dynamic program,
    ties to the lexicographically smallest selection).
    """
    if sensitivity is None:
        if mla_layers is None or num_layers is None:
            raise ConfigError("sensitivity: required unless an explicit `mla_layers` list and `num_layers` are given")
        L = num_layers
    else:
        if isinstance(sensitivity, (str, bytes)) or not isinstance(sensitivity, Sequence):
            raise ConfigError(f"sensitivity: expected a list of per-layer values, got {type(sensitivity).__name__}")
        L = len(sensitivity)
        if num_layers is not None and num_layers != L:
            raise ConfigError(f"sensitivity: {L} values for a {num_layers}-layer model")
    if mla_layers is not None:
        _check_n(n_mla, L)
        return validate_layers(mla_layers, n_mla, L, field="mla_layers")

    rule = selection_rule(sensitivity, n_mla)
    s = [float(v) for v in sensitivity]
    if n_mla < 2:
        return [0] * n_mla
    last, lo, hi, gaps = rule["last"], rule["gap_lo"], rule["gap_hi"], n_mla - 1
    steps = (lo,) if lo == hi else (lo, hi)
    neg = -math.inf
    # best[k][p]: largest sum of s over chain positions k..N-1 when position k is layer p and the chain
    # reaches `last` at position N-1 using only allowed gaps (-inf when it cannot).
    best = [[neg] * (last + 1) for _ in range(n_mla)]
    best[gaps][last] = s[last]
    for k in range(gaps - 1, -1, -1):
        for p in range(k * lo, min(k * hi, last) + 1):
            nxt = max((best[k + 1][p + g] for g in steps if p + g <= last), default=neg)
            if nxt > neg:
                best[k][p] = s[p] + nxt
    if best[0][0] == neg:  # cannot happen: the rule always admits a selection
        raise AssertionError(f"no selection satisfies the rule {rule}")  # pragma: no cover
    chosen, p = [0], 0
    for k in range(1, n_mla):  # walk forward; the smaller step on ties -> lexicographically smallest optimum
        p = max((p + g for g in steps if p + g <= last), key=lambda q: (best[k][q], -q))
        chosen.append(p)
    return chosen


def selection_sum(sensitivity: Sequence[float], chosen: Sequence[int]) -> float:
    return float(sum(sensitivity[i] for i in chosen))


def restore_layers(sensitivity: Sequence[float], n_mla: int) -> List[int]:
    """``kl_restore``: the ``n_mla`` layers whose restoring to attention lowers the KL most (largest ``s_i``; a
    tie goes to the earlier layer), sorted. No spacing rule: the choice may cluster, as the KL-guided selection
    of fla-org/hybrid-distillation (arXiv 2512.20569) does."""
    s = [_finite(f"sensitivity[{i}]", v) for i, v in enumerate(sensitivity)]
    n = _check_n(n_mla, len(s))
    return sorted(sorted(range(len(s)), key=lambda i: (-s[i], i))[:n])


METHODS = {"smart": select_layers, "kl_restore": restore_layers}
