"""fla's Triton kernels on a CPU through the Triton interpreter (``TRITON_INTERPRET=1``), fp32, tiny shapes.

Two differences between compiled Triton and the interpreter stop fla's kernels there; :func:`enable` patches
both, and must run before ``triton`` (and so ``fla``) is first imported, in a process of its own (the
environment variable and the patches hold for the whole process):

1. ``triton.autotune`` benchmarks every config, which needs a GPU: the patched ``Autotuner`` keeps the first
   config only (triton/runtime/autotuner.py ``Autotuner.__init__``).
2. Compiled Triton gives the loop variable of ``range`` / ``tl.range`` tensor semantics (fla writes
   ``i_t.to(tl.int64)``); the interpreter runs the loop as a Python loop over ints. The interpreter already
   rewrites each kernel's AST (triton/runtime/interpreter.py ``ASTTransformer``: ``x = value`` becomes
   ``x = interpreter_semantic.to_tensor(value, False)``); the patched transformer also rebinds the loop
   variable of every ``for NAME in range(...)`` / ``tl.range(...)`` loop the same way at the top of the body
   (``tl.static_range`` loops keep ints: they may index tuples).
"""
from __future__ import annotations

import ast
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

from hybridlm.bench import loss_parity as LP
from hybridlm.bench.peer_weights import MAPPERS, load_peer_weights
from hybridlm.model import HybridConfig, HybridForCausalLM

_DONE = False
_LOOPS = {"range", "tl.range", "triton.language.range"}


def _callee(node) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def enable() -> None:
    """Interpreter on, autotuning to one config, loop variables as interpreter tensors. Idempotent."""
    global _DONE
    if _DONE:
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("fla_interpret.enable() must run before triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"

    from triton.runtime import autotuner, interpreter

    init = autotuner.Autotuner.__init__

    def first_config_only(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:1] if configs else configs, *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config_only

    class LoopVarTransformer(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            if isinstance(node.target, ast.Name) and _callee(node.iter) in _LOOPS:
                name = node.target.id
                rebind = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                      attr="to_tensor", ctx=ast.Load()),
                                   args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                                   keywords=[]))
                node.body.insert(0, ast.copy_location(rebind, node))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVarTransformer()
    _DONE = True


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


def _capture(modules):
    """Forward hooks storing each module's output (the first element of a tuple) by name; returns the dict
    and the handles."""
    out, handles = {}, []
    for name, m in modules.items():
        def hook(_m, _inp, o, name=name):
            out[name] = (o[0] if isinstance(o, tuple) else o).detach().clone()
        handles.append(m.register_forward_hook(hook))
    return out, handles


def compare_causal_lm(family: str, seed: int = 0, batch: int = 2, seq: int = 64, noise_seed: int = 2,
                      **overrides) -> dict:
    """fla's ``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM`` (built as the loss-parity bench builds it, at the
    tests' tiny shape: tests/conftest.py ``tiny_config``), its weights moved off init, copied onto our
    ``HybridForCausalLM`` (torch path); one batch through both with grad enabled (fla's chunk kernels, as in
    training), the loss (fla: its default criterion in training, see :class:`CpuFusedCrossEntropy`) backward. Returns the differences of logits,
    loss, each sublayer's output, the final norm and every parameter's gradient (ours vs fla)."""



    enable()
    values = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, hybrid_override_pattern=FAMILIES[family],
        mixer=family, backend="torch",
        gdn=dict(num_heads=2, head_dim=16, num_v_heads=4, head_v_dim=8),
        kda=dict(num_heads=2, head_dim=16, num_v_heads=2, head_v_dim=16))
    values.update(overrides)
    cfg = HybridConfig(**values)
    peer, _ = LP.build_peer("fla", family, cfg, seed, SimpleNamespace(seq=seq, peer_chunk_size=16, peer_init="fla"))
    _move_weights(peer, noise_seed)
    torch.manual_seed(seed + 1)
    ours = HybridForCausalLM(cfg)
    load_peer_weights(ours, peer, "fla", family)
    peer.train(), ours.train()  # no dropout in either; fla's layers take the chunk kernels with grad enabled
    if peer.config.fuse_cross_entropy:
        peer.criterion = CpuFusedCrossEntropy()
    fused_linear = family == "kda" or getattr(peer.config, "fuse_linear_cross_entropy", False)

    n_blocks = len(peer.model.layers)
    fla_mods = {"embed": peer.model.embeddings, "norm": peer.model.norm}
    our_mods = {"embed": ours.model.embed_tokens, "norm": ours.model.norm}
    for i in range(n_blocks):
        fla_mods[f"block{i}.mixer"] = peer.model.layers[i].attn
        fla_mods[f"block{i}.mlp"] = peer.model.layers[i].mlp
        our_mods[f"block{i}.mixer"] = ours.model.layers[2 * i].mixer
        our_mods[f"block{i}.mlp"] = ours.model.layers[2 * i + 1].mixer
    fla_acts, h1 = _capture(fla_mods)
    our_acts, h2 = _capture(our_mods)

    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed + 7))
    # logits (and each sublayer's output) first, without labels: fla's loss path in training may not make
    # logits (KDA's fused linear cross-entropy), and fla's fused CE backward overwrites them in place
    t0 = time.perf_counter()
    fla_logits = peer(input_ids=ids).logits.detach()
    t_fla_fwd = time.perf_counter() - t0
    our_logits = ours(input_ids=ids).logits.detach()
    for h in h1 + h2:
        h.remove()
    t0 = time.perf_counter()
    out = peer(input_ids=ids, labels=ids)
    out.loss.backward()
    t_fla = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = ours(input_ids=ids, labels=ids)
    mine.loss.backward()
    t_ours = time.perf_counter() - t0

    # the loss from fla's logits in plain torch: separates fla's CE kernel from its forward
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    torch_ce = torch.nn.functional.cross_entropy(fla_logits.reshape(-1, fla_logits.shape[-1]), shift.reshape(-1))

    fla_grads = MAPPERS[("fla", family)]({n: p.grad for n, p in peer.named_parameters() if p.grad is not None})
    grads = {n: _diff(p.grad, fla_grads[n]) for n, p in ours.named_parameters()}
    return {
        "family": family, "seconds": {"fla_fwd": t_fla_fwd, "fla_fwd_bwd": t_fla, "ours_fwd_bwd": t_ours},
        "fla_loss_path": "FusedLinearCrossEntropyLoss" if fused_linear else "FusedCrossEntropyLoss",
        "loss": {"ours": mine.loss.item(), "fla": out.loss.item(), "fla_logits_torch_ce": torch_ce.item(),
                 "abs_diff": abs(mine.loss.item() - out.loss.item())},
        "logits": _diff(our_logits, fla_logits),
        "activations": {n: _diff(our_acts[n], fla_acts[n]) for n in fla_mods},
        "grads": grads,
    }


if __name__ == "__main__":  # python -m hybridlm.bench.fla_interpret gdn|kda  -> one JSON line
    enable()
    print(json.dumps(compare_causal_lm(sys.argv[1])))
