"""fla's Triton kernels on a CPU through the Triton interpreter (``TRITON_INTERPRET=1``), fp32, tiny shapes: our causal
LM against fla's on the same weights. :func:`enable` (tests/support/triton_interpreter.py) must run before ``triton``
(and so ``fla``) is first imported, in a process of its own.
"""
from __future__ import annotations

import copy
import json
import re
import sys
import time
from types import SimpleNamespace

import torch
from transformers.utils import ModelOutput

from benchmarks.harness import loss_parity as LP
from benchmarks.harness.peer_weights import MAPPERS, load_peer_weights
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.modeling import HybridBlock
from tests.support.triton_interpreter import enable  # noqa: F401 (callers run F.enable() first)

# ------------------------------------------------------------------ ours vs fla's causal LM, same weights

FAMILIES = {"gdn": "G-G-", "kda": "K-K-"}


class CpuFusedCrossEntropy:
    """The criterion fla's causal LMs build by default (fla/models/modeling_utils.py
    ``_compute_logits_and_loss``), usable on a CPU; set as the model's ``criterion``. Called with logits and
    targets: ``FusedCrossEntropyLoss(inplace_backward=True)`` (GDN, ``fuse_cross_entropy=True``) without its
    CUDA-only device assert (fla/modules/fused_cross_entropy/ops.py ``FusedCrossEntropyLoss.forward``): the same
    Triton kernel (``cross_entropy_loss``), the same mean over non-ignored targets. Called with hidden states,
    targets and the head's weight and bias: ``FusedLinearCrossEntropyLoss()`` as is (KDA in training:
    fla/models/kda/modeling_kda.py passes ``fuse_linear_cross_entropy=fuse_cross_entropy and training``)."""

    ignore_index, reduction = -100, "mean"

    def __call__(self, *args):
        if len(args) == 2:
            from fla.modules.fused_cross_entropy.ops import cross_entropy_loss
            logits, target = args
            loss, _ = cross_entropy_loss(logits=logits, target=target, ignore_index=self.ignore_index,
                                         inplace_backward=True)
            return loss.sum() / (target != self.ignore_index).sum()
        from fla.modules.fused_linear_cross_entropy.ops import FusedLinearCrossEntropyLoss
        return FusedLinearCrossEntropyLoss(ignore_index=self.ignore_index)(*args)


def _move_weights(model, seed: int) -> None:
    """Every weight moved by seeded noise (half its std, or 0.3 for constant tensors: norm weights, biases),
    so that gates, norms, A_log and dt_bias sit at no special value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            std = p.std().item() if p.numel() > 1 else 0.0
            p.add_(torch.randn(p.shape, generator=g) * (0.5 * std if std > 1e-3 else 0.3))


def _diff(a, b) -> dict:
    """max |a - b|, that over max |b|, and the relative Frobenius error."""
    a, b = a.detach().double(), b.detach().double()
    d = (a - b).abs().max().item()
    scale = b.abs().max().item()
    return {"max_abs": d, "max_rel": d / scale if scale else float("inf"),
            "fro_rel": ((a - b).norm() / b.norm()).item() if b.norm() > 0 else float("inf")}


# fla's activations (every tensor a module of fla's causal LM outputs in the forward) -> ours. fla's names: the
# module's name, ``[i]`` for the i-th tensor of a tuple output, ``.key`` for a ModelOutput's tensors. Ours, one of:
# ``NAME`` (that module's output), ``NAME:input`` (its first input) or ``NAME.add_and_normalise[1]`` (the residual
# stream that norm returns beside its output: in training with ``fuse_residual_norm``, ours leaves each block's
# residual add to the next norm, hybridlm/model/modeling.py ``_forward_residual_adds_in_norms``, so neither the
# stream between blocks nor the final norm's output comes out of a module's forward). fla block ``i`` is our
# sublayers ``2i`` (mixer) and ``2i + 1`` (MLP), as benchmarks/harness/peer_weights.py ``map_fla_delta_rule`` maps the
# weights. The first rule whose pattern matches an fla name whole gives its counterpart.
_BLOCK = r"model\.layers\.(?P<i>\d+)"
ACTIVATION_MAP = (
    (r"model\.embeddings", "model.embed_tokens"),
    (_BLOCK + r"\.attn_norm", "model.layers.{mixer}.mixer:input"),
    # ours applies the gated output norm as a function (hybridlm/ops/elementwise.py gated_rms_norm): its output,
    # heads flattened, is o_proj's input
    (_BLOCK + r"\.attn\.o_norm", "model.layers.{mixer}.mixer.o_proj:input"),
    (_BLOCK + r"\.attn\[0\]", "model.layers.{mixer}.mixer"),
    (_BLOCK + r"\.mlp_norm\[0\]", "model.layers.{mlp}.mixer:input"),
    (_BLOCK + r"\.mlp_norm\[1\]", "model.layers.{mlp}.norm.add_and_normalise[1]"),  # fla: prenorm=True, x + residual
    (_BLOCK + r"\.mlp\.(?P<sub>gate_proj|up_proj)", "model.layers.{mlp}.mixer.{sub}"),
    (_BLOCK + r"\.mlp\.swiglu_linear", "model.layers.{mlp}.mixer.down_proj"),  # down_proj(swiglu(gate, up))
    (_BLOCK + r"\.mlp", "model.layers.{mlp}.mixer"),
    (_BLOCK + r"\[0\]", "{next_norm}.add_and_normalise[1]"),  # the residual stream after the block
    (r"model\.norm", "model"),  # HybridModel's output is the final norm's
    (r"model\.last_hidden_state", "model"),
    (r"lm_head", "lm_head"),
)
# the mixers' own linears, the same names in both
MIXER_MAP = {
    "gdn": ((_BLOCK + r"\.attn\.(?P<sub>[qkvabg]_proj|o_proj)", "model.layers.{mixer}.mixer.{sub}"),),
    "kda": ((_BLOCK + r"\.attn\.(?P<sub>[qkvb]_proj|[fg]_proj\.[01]|o_proj)", "model.layers.{mixer}.mixer.{sub}"),
            # the two-linear gates (nn.Sequential): fla calls the Sequential, ours its two linears
            (_BLOCK + r"\.attn\.(?P<sub>[fg]_proj)", "model.layers.{mixer}.mixer.{sub}.1")),
}
# fla activations ours has no tensor for, each with the reason
NO_COUNTERPART = (
    # KDA (fla's GDN runs one fused conv over q | k | v in training, without calling these modules)
    (_BLOCK + r"\.attn\.[qkv]_conv1d\[0\]",
     "ours runs silu(conv(x)) as a function over its ShortConv's weights (hybridlm/model/layers/conv.py "
     "run_short_conv), so no module outputs it; it reaches the compared o_norm only through the delta rule"),
)


def counterpart(fla_name: str, family: str, n_blocks: int):
    """``(our key, None)`` for an fla activation (:data:`MIXER_MAP`, :data:`ACTIVATION_MAP`), ``(None, reason)``
    for one listed in :data:`NO_COUNTERPART`; a name none of them knows raises ``KeyError``."""
    for pattern, template in MIXER_MAP[family] + ACTIVATION_MAP:
        m = re.fullmatch(pattern, fla_name)
        if m:
            fields = m.groupdict()
            if "i" in fields:
                i = int(fields["i"])
                fields.update(mixer=2 * i, mlp=2 * i + 1,
                              next_norm=f"model.layers.{2 * i + 2}.norm" if i + 1 < n_blocks else "model.norm")
            return template.format(**fields), None
    for pattern, reason in NO_COUNTERPART:
        if re.fullmatch(pattern, fla_name):
            return None, reason
    raise KeyError(f"fla activation {fla_name!r}: no counterpart in ours (MIXER_MAP, ACTIVATION_MAP) and no reason "
                   "for none (NO_COUNTERPART)")


def _tensors(name: str, out) -> dict:
    """A module's output as ``{name: tensor}``, detached copies (see :data:`ACTIVATION_MAP` for the names)."""
    if isinstance(out, torch.Tensor):
        return {name: out.detach().clone()}
    if isinstance(out, ModelOutput):
        return {f"{name}.{k}": v.detach().clone() for k, v in out.items() if isinstance(v, torch.Tensor)}
    if isinstance(out, (tuple, list)):
        return {f"{name}[{i}]": v.detach().clone() for i, v in enumerate(out) if isinstance(v, torch.Tensor)}
    return {}


def _capture_all(model) -> tuple:
    """Forward hooks on every submodule of ``model`` (not ``model`` itself: a causal LM's own output is its
    logits, compared as such), storing each output tensor in forward order; returns the dict and the handles."""
    out, handles = {}, []
    for name, m in model.named_modules():
        if name:
            handles.append(m.register_forward_hook(lambda _m, _inp, o, name=name: out.update(_tensors(name, o))))
    return out, handles


def _capture_ours(model, keys) -> tuple:
    """Our tensors named by ``keys`` (see :data:`ACTIVATION_MAP`), captured by forward hooks, forward pre-hooks
    and a recording wrapper on a norm's ``add_and_normalise``; returns the dict and an undo function. No hook goes
    on a ``HybridBlock``: one there switches ours to its block loop (hybridlm/model/modeling.py ``_blocks_hooked``),
    which is not the path ours trains on."""
    out, undo = {}, []
    for key in keys:
        if key.endswith(".add_and_normalise[1]"):
            norm = model.get_submodule(key[: -len(".add_and_normalise[1]")])

            def recording(x, delta, key=key, method=norm.add_and_normalise):
                h, stream = method(x, delta)
                out[key] = stream.detach().clone()
                return h, stream
            norm.add_and_normalise = recording
            undo.append(lambda norm=norm: vars(norm).pop("add_and_normalise"))
            continue
        name, _, kind = key.partition(":")
        module = model.get_submodule(name)
        if isinstance(module, HybridBlock):
            raise ValueError(f"{key}: a hook on a HybridBlock changes the path ours takes")
        if kind == "input":
            h = module.register_forward_pre_hook(lambda _m, args, key=key: out.update({key: args[0].detach().clone()}))
        else:
            h = module.register_forward_hook(lambda _m, _inp, o, key=key: out.update(_tensors(key, o)))
        undo.append(h.remove)
    return out, lambda: [u() for u in undo]


def _forward_ours(ours, ids, keys) -> dict:
    """Our logits and the activations ``keys``: a forward without labels."""
    acts, undo = _capture_ours(ours, keys)
    logits = ours(input_ids=ids).logits.detach()
    undo()
    return {"logits": logits, "acts": acts}


def _backward_ours(ours, ids, run: dict) -> dict:
    """``run`` with our loss and every parameter's gradient: a forward with labels, backward."""
    t0 = time.perf_counter()
    out = ours(input_ids=ids, labels=ids)
    out.loss.backward()
    return {**run, "loss": out.loss.item(), "seconds": time.perf_counter() - t0,
            "grads": {n: p.grad for n, p in ours.named_parameters()}}


def _compare(mine: dict, fla: dict, pairs: dict) -> dict:
    """Ours against fla: loss, logits, each paired activation (ours reshaped to fla's shape: equal sizes),
    every gradient."""
    acts = {}
    for fla_name, key in pairs.items():
        a, b = mine["acts"][key], fla["acts"][fla_name]
        if a.numel() != b.numel():
            raise ValueError(f"{fla_name} {tuple(b.shape)} vs our {key} {tuple(a.shape)}: sizes differ")
        acts[fla_name] = _diff(a.reshape(b.shape), b)
    return {
        "loss": {"ours": mine["loss"], "fla": fla["loss"], "fla_logits_torch_ce": fla["torch_ce"],
                 "abs_diff": abs(mine["loss"] - fla["loss"])},
        "logits": _diff(mine["logits"], fla["logits"]),
        "activations": acts,
        "grads": {n: _diff(g, fla["grads"][n]) for n, g in mine["grads"].items()},
    }


def compare_causal_lm(family: str, seed: int = 0, batch: int = 2, seq: int = 64, noise_seed: int = 2,
                      perturb: str | None = None, perturb_by: float = 1e-3, **overrides) -> dict:
    """fla's ``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM`` (built as the loss-parity bench builds it, at the
    tests' tiny shape: tests/conftest.py ``tiny_config``), its weights moved off init, copied onto our
    ``HybridForCausalLM`` (torch path); one batch through both with grad enabled (fla's chunk kernels, as in
    training; ours on its training path, residual adds in the norms), the loss (fla: its default criterion in
    training, see :class:`CpuFusedCrossEntropy`) backward. Returns the differences of logits, loss, every
    activation of fla's paired with ours by :data:`ACTIVATION_MAP` (``fla_only``: those listed in
    :data:`NO_COUNTERPART`, with the reason) and every parameter's gradient (ours vs fla).

    ``perturb`` (one of our parameter names): also ``perturbed``, the same comparison for a copy of ours whose
    first entry of that parameter moved by ``perturb_by`` times the parameter's largest magnitude, against the
    same fla run: the comparison must notice it."""
    enable()
    values = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, hybrid_override_pattern=FAMILIES[family],
        mixer=family, runtime={"backend": "torch"},
        gdn=dict(num_heads=2, head_dim=16, num_v_heads=4, head_v_dim=8),
        kda=dict(num_heads=2, head_dim=16, num_v_heads=2, head_v_dim=16))
    values.update(overrides)
    cfg = HybridConfig(**values)
    peer, _ = LP.build_peer("fla", family, cfg, seed, SimpleNamespace(seq=seq, peer_chunk_size=16, peer_init="fla"))
    _move_weights(peer, noise_seed)
    torch.manual_seed(seed + 1)
    ours = HybridForCausalLM(cfg)
    load_peer_weights(ours, peer, "fla", family)
    moved = None
    if perturb is not None:
        moved = copy.deepcopy(ours)
        with torch.no_grad():
            p = moved.get_parameter(perturb)
            p.view(-1)[0] += perturb_by * p.abs().max()
    peer.train(), ours.train()  # no dropout in either; fla's layers take the chunk kernels with grad enabled
    if peer.config.fuse_cross_entropy:
        peer.criterion = CpuFusedCrossEntropy()
    fused_linear = family == "kda" or getattr(peer.config, "fuse_linear_cross_entropy", False)

    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed + 7))
    # logits (and every activation) first, without labels: fla's loss path in training may not make logits
    # (KDA's fused linear cross-entropy), and fla's fused CE backward overwrites them in place
    fla_acts, handles = _capture_all(peer)
    t0 = time.perf_counter()
    fla_logits = peer(input_ids=ids).logits.detach()
    t_fla_fwd = time.perf_counter() - t0
    for h in handles:
        h.remove()

    # every fla activation paired with ours or listed without a counterpart, before the slow backward
    n_blocks = len(peer.model.layers)
    pairs, fla_only, unknown = {}, {}, []
    for name in fla_acts:
        try:
            key, reason = counterpart(name, family, n_blocks)
        except KeyError:
            unknown.append(name)
            continue
        if key is None:
            fla_only[name] = reason
        else:
            pairs[name] = key
    if unknown:
        raise ValueError(f"fla activations with no counterpart in ours and no reason for none: {unknown} "
                         "(tests/support/fla_interpret.py MIXER_MAP, ACTIVATION_MAP, NO_COUNTERPART)")

    keys = set(pairs.values())
    mine = _forward_ours(ours, ids, keys)
    missing = {n: k for n, k in pairs.items() if k not in mine["acts"]}
    if missing:
        raise ValueError(f"fla activations whose counterpart our forward did not produce: {missing}")

    t0 = time.perf_counter()
    out = peer(input_ids=ids, labels=ids)
    out.loss.backward()
    t_fla = time.perf_counter() - t0
    # the loss from fla's logits in plain torch: separates fla's CE kernel from its forward
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    torch_ce = torch.nn.functional.cross_entropy(fla_logits.reshape(-1, fla_logits.shape[-1]), shift.reshape(-1))
    fla = {"logits": fla_logits, "acts": fla_acts, "loss": out.loss.item(), "torch_ce": torch_ce.item(),
           "grads": MAPPERS[("fla", family)]({n: p.grad for n, p in peer.named_parameters() if p.grad is not None})}
    mine = _backward_ours(ours, ids, mine)
    result = {
        "family": family, "seconds": {"fla_fwd": t_fla_fwd, "fla_fwd_bwd": t_fla, "ours_fwd_bwd": mine["seconds"]},
        "fla_loss_path": "FusedLinearCrossEntropyLoss" if fused_linear else "FusedCrossEntropyLoss",
        **_compare(mine, fla, pairs),
        "pairs": pairs, "fla_only": fla_only,
    }
    if moved is not None:
        moved.train()
        result["perturbed"] = {"param": perturb, "by": perturb_by,
                               **_compare(_backward_ours(moved, ids, _forward_ours(moved, ids, keys)), fla, pairs)}
    return result


if __name__ == "__main__":  # python -m tests.support.fla_interpret gdn|kda  -> one JSON line
    enable()
    print(json.dumps(compare_causal_lm(sys.argv[1])))
