"""The named parameter groups of an upcycled student, for per-group learning rates (``optim.group_lr``).

* ``inherited``: what the student took from the teacher unchanged: embeddings, LM head, norms, MLPs;
* ``mixer``: the linear mixers (Mamba2, GDN, KDA or any registered linear mixer), new weights;
* ``latent``: the attention mixers (MLA: the SVD-initialised latent projections and their output projection).

fla-org/hybrid-distillation (arXiv 2512.20569) distils end-to-end with the inherited weights at ~7e-6 and the
mixers at ~1e-4: ``optim: {lr: 1.0e-4, group_lr: {inherited: 7.0e-6}}``. A group at lr 0 is frozen.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

from torch import nn

from hybridlm.model.registry import is_mixer, mixer_spec

GROUPS = ("inherited", "mixer", "latent")


def group_of_kind(kind: str) -> str:
    """The group of a sublayer's mixer parameters: ``mixer`` for a linear mixer, ``latent`` for attention,
    ``inherited`` for an MLP."""
    if not is_mixer(kind):
        return "inherited"
    return "mixer" if mixer_spec(kind).linear else "latent"


def student_param_groups(student: nn.Module, params: Iterable[nn.Parameter]) -> Dict[str, List[nn.Parameter]]:
    """``params`` (parameters of a :class:`hybridlm.model.HybridForCausalLM`) by group, in :data:`GROUPS` order.
    A sublayer's ``mixer`` parameters belong to its kind's group; its pre-norm and everything outside the layers
    are ``inherited``."""
    wanted = {id(p) for p in params}
    groups: Dict[str, List[nn.Parameter]] = {g: [] for g in GROUPS}
    mixer_group = {}
    for block in student.model.layers:
        for p in block.mixer.parameters():
            mixer_group[id(p)] = group_of_kind(block.kind)
    for p in student.parameters():
        if id(p) in wanted:
            groups[mixer_group.get(id(p), "inherited")].append(p)
            wanted.discard(id(p))
    if wanted:
        raise ValueError(f"student_param_groups: {len(wanted)} parameter(s) do not belong to the student")
    return groups
