"""A loss-parity peer's weights copied onto our ``HybridForCausalLM``: the ``peer`` init variant of
:mod:`benchmarks.harness.loss_parity` (ours starting from the exact initial weights of the peer built with the same
seed), which separates the initialisation from everything else (forward numerics, parameterisation).

One function per peer kind maps the peer's state dict to our parameter names and shapes:

- fla's ``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM`` (fla/models/gated_deltanet, fla/models/kda):
  block ``i`` (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``) is our sublayers ``2i`` (the mixer) and ``2i + 1``
  (the MLP) of a pattern ``G-G-...`` / ``K-K-...``; ``attn.o_norm.weight`` is our ``mixer.o_norm_weight``;
  the ``ShortConvolution`` kernels ``[C, 1, K]`` are our ``ShortConv`` weights ``[C, K]``
  (hybridlm/model/layers/conv.py). Every other mixer name (q/k/v/a/b/g/f projections, A_log, dt_bias) is ours.
- fla's and transformers' ``Mamba2ForCausalLM`` (fla/models/mamba2, transformers/models/mamba2; the same names):
  ``backbone.embeddings`` / ``backbone.norm_f`` are our ``model.embed_tokens`` / ``model.norm``, block ``i`` is our
  sublayer ``i`` (pattern ``MMM...``), ``mixer.norm.weight`` (the gated norm) is our ``mixer.norm_weight`` and
  ``conv1d.weight [C, 1, K]`` our ``[C, K]``. ``in_proj`` rows are ``[z | x | B | C | dt]`` in all three
  (hybridlm/model/layers/mamba2.py, fla/layers/mamba2.py, transformers' ``Mamba2Mixer``), so it is copied as is.
- ``ours``: our own model, the names unchanged.

Same weights, different function, in one case: fla's Mamba2 without ``mamba_ssm`` runs its naive torch SSD
(``fla.layers.mamba2.Mamba2.torch_forward``), which spreads B and C over the heads with ``repeat`` (head ``h``
reads group ``h % n_groups``), while ours, mamba_ssm's kernels and transformers' torch path give each group
consecutive heads (head ``h`` reads group ``h // (num_heads / n_groups)``). With ``1 < n_groups < num_heads``
(configs/models/mamba2_300m.yaml: 8 groups of 4 heads) ours loaded with such a peer's weights does not compute
the peer's function; tests/test_peer_weights.py measures it.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

StateDict = Dict[str, torch.Tensor]
Rule = Tuple[str, Callable[[re.Match], str]]

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _rename(state: StateDict, rules: Sequence[Rule]) -> StateDict:
    """Each name through the first rule whose pattern matches it whole; a name no rule knows stays as it is
    (so that :func:`load_peer_weights` reports it as a peer tensor without a place in ours)."""
    out: StateDict = {}
    for name, tensor in state.items():
        new = name
        for pattern, repl in rules:
            m = re.fullmatch(pattern, name)
            if m:
                new = repl(m)
                break
        if new in out:
            raise ValueError(f"peer tensors {name} and another both map to {new}")
        out[new] = tensor
    return out


def _conv_kernels(state: StateDict) -> StateDict:
    """``nn.Conv1d`` depthwise kernels ``[C, 1, K]`` (fla's ``ShortConvolution``, both Mamba2 ``conv1d``) as our
    ``ShortConv`` weights ``[C, K]``."""
    return {n: t.squeeze(1) if n.endswith("conv1d.weight") and t.dim() == 3 and t.shape[1] == 1 else t
            for n, t in state.items()}


def map_fla_delta_rule(state: StateDict) -> StateDict:
    """fla's GatedDeltaNet / KDA causal LM (fla/models/gated_deltanet, fla/models/kda): one block (mixer + MLP)
    -> two of our sublayers."""
    def block(i: str, k: int) -> str:
        return f"model.layers.{2 * int(i) + k}"
    rules: List[Rule] = [
        (r"model\.embeddings\.weight", lambda m: EMBED),
        (r"model\.layers\.(\d+)\.attn_norm\.weight", lambda m: f"{block(m[1], 0)}.norm.weight"),
        (r"model\.layers\.(\d+)\.attn\.o_norm\.weight", lambda m: f"{block(m[1], 0)}.mixer.o_norm_weight"),
        (r"model\.layers\.(\d+)\.attn\.(.+)", lambda m: f"{block(m[1], 0)}.mixer.{m[2]}"),
        (r"model\.layers\.(\d+)\.mlp_norm\.weight", lambda m: f"{block(m[1], 1)}.norm.weight"),
        (r"model\.layers\.(\d+)\.mlp\.(.+)", lambda m: f"{block(m[1], 1)}.mixer.{m[2]}"),
    ]
    return _conv_kernels(_rename(state, rules))


def _map_mamba2_backbone(state: StateDict) -> StateDict:
    rules: List[Rule] = [
        (r"backbone\.embeddings\.weight", lambda m: EMBED),
        (r"backbone\.norm_f\.weight", lambda m: "model.norm.weight"),
        (r"backbone\.layers\.(\d+)\.mixer\.norm\.weight", lambda m: f"model.layers.{m[1]}.mixer.norm_weight"),
        (r"backbone\.layers\.(\d+)\.(.+)", lambda m: f"model.layers.{m[1]}.{m[2]}"),
    ]
    return _conv_kernels(_rename(state, rules))


def map_fla_mamba2(state: StateDict) -> StateDict:
    """fla's Mamba2 causal LM (fla/models/mamba2/modeling_mamba2.py): one mixer block -> one of our sublayers."""
    return _map_mamba2_backbone(state)


def map_hf_mamba2(state: StateDict) -> StateDict:
    """transformers' Mamba2 causal LM (transformers/models/mamba2/modeling_mamba2.py): names as fla's."""
    return _map_mamba2_backbone(state)


def map_ours(state: StateDict) -> StateDict:
    """Our own model as the peer (``--peer ours``): nothing to rename."""
    return dict(state)


MAPPERS: Dict[Tuple[str, str], Callable[[StateDict], StateDict]] = {
    ("fla", "gdn"): map_fla_delta_rule, ("fla", "kda"): map_fla_delta_rule, ("fla", "mamba2"): map_fla_mamba2,
    ("hf", "mamba2"): map_hf_mamba2,
    ("ours", "gdn"): map_ours, ("ours", "kda"): map_ours, ("ours", "mamba2"): map_ours,
}


def _ties_head_to_embeddings(model) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


def _mismatches(mapped: StateDict, ours: StateDict) -> List[str]:
    """Every difference between the mapped peer tensors and our state dict, one short phrase each."""
    problems = [f"{n}: ours has no such tensor (peer tensor unused)" for n in mapped if n not in ours]
    problems += [f"{n}: no peer tensor maps to it (left unassigned)" for n in ours if n not in mapped]
    problems += [f"{n}: shape peer {tuple(mapped[n].shape)} != ours {tuple(t.shape)}"
                 for n, t in ours.items() if n in mapped and mapped[n].shape != t.shape]
    return problems


def mapped_peer_state(ours, peer, kind: str, family: str) -> StateDict:
    """The peer's state dict under our names and shapes, checked against ours: ValueError (one line, naming the
    first offending tensor) if a tensor of ours is left unassigned, a peer tensor is unused or a shape differs."""
    where = f"peer {kind} {family} -> ours"
    if (kind, family) not in MAPPERS:
        raise ValueError(f"{where}: no weight mapping (known: {', '.join(f'{k} {f}' for k, f in MAPPERS)})")
    tied = _ties_head_to_embeddings(ours)
    if tied != _ties_head_to_embeddings(peer):
        raise ValueError(f"{where}: {HEAD} is {'' if tied else 'not '}tied to the embeddings in ours and "
                         f"{'not ' if tied else ''}in the peer")
    mapped = MAPPERS[(kind, family)](peer.state_dict())
    if tied and EMBED in mapped:  # one tensor in both: the embedding's copy serves the head
        mapped[HEAD] = mapped[EMBED]
    problems = _mismatches(mapped, ours.state_dict())
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{where}: {problems[0]}{more}")
    return mapped


@torch.no_grad()
def load_peer_weights(ours, peer, kind: str, family: str, names: Optional[Sequence[str]] = None) -> int:
    """Copy every weight of ``peer`` (a loss-parity peer of ``kind`` fla / hf / ours for ``family``) into
    ``ours`` (strictly: see :func:`mapped_peer_state`), or with ``names`` only our tensors whose dotted name has
    one of them as a component (``out_proj`` matches ``model.layers.3.mixer.out_proj.weight``; ValueError for a
    name that matches none); returns the number of tensors copied."""
    mapped = mapped_peer_state(ours, peer, kind, family)
    if names is not None:
        unmatched = [n for n in names if not any(n in key.split(".") for key in mapped)]
        if unmatched:
            raise ValueError(f"no tensor of ours is named {unmatched[0]!r} (names are components of e.g. "
                             f"{next(iter(mapped))})")
        mapped = {k: v for k, v in mapped.items() if any(n in k.split(".") for n in names)}
    ours.load_state_dict(mapped, strict=names is None)
    return len(mapped)


def fla_mamba2_reads_groups_tiled(peer) -> bool:
    """Whether fla's Mamba2 ``peer`` runs the naive torch SSD (no ``mamba_ssm``) with ``1 < n_groups <
    num_heads``, where its heads read B and C in another group order than ours (see the module docstring)."""
    from fla.layers.mamba2 import is_fast_path_available
    cfg = peer.config
    return not is_fast_path_available and 1 < cfg.n_groups < cfg.num_heads
