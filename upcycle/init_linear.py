"""A linear-time mixer initialised from a Llama attention (MambaInLlama: q / k / v / o play the roles of a linear
recurrence's C / B / x / out), found through the mixer's registry entry.

A mixer that can be upcycled names a :class:`FromAttention` in its entry (``register_mixer(...,
from_attention="upcycle.init_<name>:FROM_ATTENTION")``, loaded here on use: the library never imports a stage);
its student's settings and its weight copy come from there, so no list of mixers is kept in this stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from hybridlm.model.registry import is_mixer, load_object, mixer_spec, mixers


@dataclass(frozen=True)
class FromAttention:
    """How ``upcycle init`` builds one linear mixer from a Llama attention."""
    # the mixer's settings (its config section) given the teacher's shapes (:func:`upcycle.student.llama_shapes`)
    student_args: Callable[[Dict[str, Any]], Dict[str, Any]]
    # ``init(mixer, attn)``: the attention's weights copied into a mixer built with those settings, in place;
    # ValueError for a shape that does not fit the teacher's heads
    init: Callable[[Any, Any], None]


def from_attention(kind: str) -> Optional[FromAttention]:
    """The :class:`FromAttention` of registered mixer ``kind`` (its entry's ``from_attention``, loaded when named
    by a string); None for a mixer that is not built from attention."""
    entry = mixer_spec(kind).from_attention
    return load_object(entry) if isinstance(entry, str) else entry


def upcycling_kinds() -> List[str]:
    """The linear mixers ``upcycle init --linear-mixer`` can build: the registered ones with a ``from_attention``."""
    return [spec.kind for spec in mixers() if spec.linear and spec.from_attention is not None]


def init_linear_mixer_from_attention(mixer, attn, kind: str) -> None:
    """Copy a Llama attention's q / k / v / o into a linear ``mixer`` of ``kind`` in place (MambaInLlama).

    ``kind`` is one of :func:`upcycling_kinds` and must match the mixer's class (its registry entry's module); any
    shape that does not fit the teacher's heads raises ValueError."""
    kinds = upcycling_kinds()
    if kind not in kinds or not is_mixer(kind):
        raise ValueError(f"kind: {kind!r} is not a linear mixer; expected one of {', '.join(kinds)}")
    module = mixer_spec(kind).module
    if not isinstance(mixer, module):
        raise ValueError(f"kind {kind!r} expects a {module.__name__}, got {type(mixer).__name__}")
    from_attention(kind).init(mixer, attn)
