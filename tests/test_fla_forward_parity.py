"""Our GDN / KDA causal LM (torch path) against fla 0.6's ``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM`` on
the same weights: logits, loss and every parameter's gradient.

fla's models run Triton kernels only; here they run on the CPU through the Triton interpreter with two patches
(hybridlm/bench/fla_interpret.py: autotuning to the first config, ``range`` loop variables as interpreter
tensors). The interpreter and the patches hold for the whole process, so each family runs in a subprocess
(``python -m hybridlm.bench.fla_interpret FAMILY``, both at once). fla takes its training path: the chunk
kernels (grad enabled) and its default criterion (GDN: the fused cross-entropy kernel; KDA in training: the
fused linear cross-entropy), fp32.

Measured (2-core CPU, both families at once, about 2 minutes): every difference at fp32 rounding, logits and losses
<= ~1e-6 relative, gradients <= ~2e-5 (A_log) relative to the largest entry.
"""
import sys

import pytest

from conftest import run_under_interpreter

pytest.importorskip("fla.models")
pytest.importorskip("triton")

REL_TOL = 1e-4
# shapes: grouped value heads (num_v_heads = 2 num_heads) and head_v_dim != head_dim as in the 300M configs;
# GDN over two of fla's 64-token chunks, so that the state crosses a chunk boundary
CASES = {
    "gdn": dict(seq=128, gdn=dict(num_heads=2, head_dim=16, num_v_heads=4, head_v_dim=8)),
    "kda": dict(seq=64, kda=dict(num_heads=2, head_dim=16, num_v_heads=4, head_v_dim=32)),
}
GRAD_GROUPS = ("conv1d.weight", "A_log", "dt_bias", "q_proj.weight", "o_norm_weight")


def _script(family):
    kwargs = dict(CASES[family])
    return ("import json\nfrom hybridlm.bench import fla_interpret as F\nF.enable()\n"
            f"print(json.dumps(F.compare_causal_lm({family!r}, **{kwargs!r})))\n")


@pytest.fixture(scope="module")
def results():
    return run_under_interpreter({f: [sys.executable, "-c", _script(f)] for f in CASES}, timeout=800)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_ours_computes_flas_logits_loss_and_gradients(results, family):
    r = results[family]
    worst = max(r["grads"].items(), key=lambda kv: kv[1]["max_rel"])
    print(f"\n{family}: {r['seconds']} loss {r['loss']} logits {r['logits']} worst grad {worst}")
    assert r["logits"]["max_rel"] < REL_TOL, r["logits"]
    for name, d in r["activations"].items():
        assert d["max_rel"] < REL_TOL, (name, d)
    loss = r["loss"]
    assert loss["abs_diff"] / loss["fla"] < REL_TOL, loss
    assert abs(loss["fla_logits_torch_ce"] - loss["fla"]) / loss["fla"] < REL_TOL, loss  # fla's CE kernel itself
    grads = r["grads"]
    for group in GRAD_GROUPS:
        assert any(group in n for n in grads), group  # each group compared in every layer below
    bad = {n: d for n, d in grads.items() if not d["max_rel"] < REL_TOL}
    assert not bad, bad
