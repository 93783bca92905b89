"""A linear-time mixer initialised from a Llama attention: the mixers that have a mapping from attention
(MambaInLlama: q / k / v / o play the roles of a linear recurrence's C / B / x / out) and the dispatch to it."""
from __future__ import annotations

from functools import partial

from hybridlm.model.registry import is_mixer, mixer_spec
from upcycle.init_delta_rule import init_delta_rule_from_attention
from upcycle.init_mamba2 import init_mamba2_from_attention

# mixer kind -> its init from attention, ``init(mixer, attn)``
FROM_ATTENTION = {"mamba2": init_mamba2_from_attention,
                  "gdn": partial(init_delta_rule_from_attention, kind="gdn"),
                  "kda": partial(init_delta_rule_from_attention, kind="kda")}
LINEAR_KINDS = tuple(FROM_ATTENTION)  # what ``upcycle init --linear-mixer`` can build


def init_linear_mixer_from_attention(mixer, attn, kind: str) -> None:
    """Copy a Llama attention's q / k / v / o into a Mamba2 / GDN / KDA ``mixer`` in place (MambaInLlama).

    ``kind`` is one of :data:`LINEAR_KINDS` and must match the mixer's class (its registry entry's module); any
    shape that does not fit the teacher's heads raises ValueError."""
    if kind not in FROM_ATTENTION or not is_mixer(kind):
        raise ValueError(f"kind: {kind!r} is not a linear mixer; expected one of {', '.join(LINEAR_KINDS)}")
    module = mixer_spec(kind).module
    if not isinstance(mixer, module):
        raise ValueError(f"kind {kind!r} expects a {module.__name__}, got {type(mixer).__name__}")
    FROM_ATTENTION[kind](mixer, attn)
