"""Our GDN / KDA causal LM (torch path, its training path: residual adds in the norms) against fla 0.6's
``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM`` on the same weights: every activation of fla's paired with ours
(tests/support/fla_interpret.py ``ACTIVATION_MAP``; an fla activation with neither a counterpart nor a listed
reason for none is an error), logits, loss and every parameter's gradient.

fla's models run Triton kernels only; here they run on the CPU through the Triton interpreter with two patches
(tests/support/fla_interpret.py: autotuning to the first config, ``range`` loop variables as interpreter
tensors). The interpreter and the patches hold for the whole process, so each family runs in a subprocess
(``python -m tests.support.fla_interpret FAMILY``, both at once). fla takes its training path: the chunk
kernels (grad enabled) and its default criterion (GDN: the fused cross-entropy kernel; KDA in training: the
fused linear cross-entropy), fp32.

Measured (2-core CPU shared with other work, both families at once, about 4 minutes): every difference at fp32
rounding: activations <= 2.6e-6 and logits <= 1.0e-6 relative to the largest entry, the losses equal, gradients
<= 9.3e-6 (A_log) relative to the largest entry.

The same subprocess also compares a copy of ours with one weight moved by 1 % of that weight's largest magnitude
against the same fla run: the checks below must fail on it, first at the activation that reads the weight.
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
# (our parameter moved, the first of fla's activations, in forward order, that reads it): the second mixer's
# decay (read first inside the delta rule, seen at its output norm) and its q projection
PERTURB = {
    "gdn": ("model.layers.2.mixer.A_log", "model.layers.1.attn.o_norm"),
    "kda": ("model.layers.2.mixer.q_proj.weight", "model.layers.1.attn.q_proj"),
}
PERTURB_BY = 1e-2


def _script(family):
    kwargs = dict(CASES[family], perturb=PERTURB[family][0], perturb_by=PERTURB_BY)
    return ("import json\nfrom tests.support import fla_interpret as F\nF.enable()\n"
            f"print(json.dumps(F.compare_causal_lm({family!r}, **{kwargs!r})))\n")


@pytest.fixture(scope="module")
def results():
    return run_under_interpreter({f: [sys.executable, "-c", _script(f)] for f in CASES}, timeout=800)


def _failures(r) -> list:
    """Every difference of a comparison (ours vs fla) at or above the tolerance."""
    bad = []
    if not r["logits"]["max_rel"] < REL_TOL:
        bad.append(("logits", r["logits"]))
    bad += [(name, d) for name, d in r["activations"].items() if not d["max_rel"] < REL_TOL]
    loss = r["loss"]
    if not loss["abs_diff"] / loss["fla"] < REL_TOL:
        bad.append(("loss", loss))
    bad += [(name, d) for name, d in r["grads"].items() if not d["max_rel"] < REL_TOL]
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_ours_computes_flas_activations_logits_loss_and_gradients(results, family):
    r = results[family]
    worst = max(r["grads"].items(), key=lambda kv: kv[1]["max_rel"])
    worst_act = max(r["activations"].items(), key=lambda kv: kv[1]["max_rel"])
    print(f"\n{family}: {r['seconds']} loss {r['loss']} logits {r['logits']} {len(r['activations'])} activations, "
          f"worst {worst_act}; worst grad {worst}; fla only: {r['fla_only']}")
    # every module of each fla block and the model's ends are compared (a mapping that drifts shows up here
    # as an error in the subprocess or as a missing name)
    for block in range(2):
        for sub in ("attn_norm", "attn.q_proj", "attn.o_norm", "attn[0]", "mlp_norm[0]", "mlp_norm[1]", "mlp", "[0]"):
            name = f"model.layers.{block}.{sub}".replace(".[", "[")
            assert name in r["activations"], name
    for name in ("model.embeddings", "model.norm", "lm_head"):
        assert name in r["activations"], name
    loss = r["loss"]
    assert abs(loss["fla_logits_torch_ce"] - loss["fla"]) / loss["fla"] < REL_TOL, loss  # fla's CE kernel itself
    grads = r["grads"]
    for group in GRAD_GROUPS:
        assert any(group in n for n in grads), group  # each group compared in every layer below
    bad = _failures(r)
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_the_comparison_notices_one_moved_weight(results, family):
    p = results[family]["perturbed"]
    param, first_reader = PERTURB[family]
    assert p["param"] == param and p["by"] == PERTURB_BY, p
    names = list(p["activations"])  # fla's forward order
    at = names.index(first_reader)
    print(f"\n{family}: {param} moved by {PERTURB_BY} of its largest magnitude: {first_reader} "
          f"{p['activations'][first_reader]}, logits {p['logits']}")
    bad = dict(_failures(p))
    assert bad  # the check the parity test applies fails
    upstream = [n for n in names[:at] if n in bad]
    assert not upstream, upstream  # the activations before the weight is read still match: pairs are aligned
    assert first_reader in bad, p["activations"][first_reader]
    assert "logits" in bad and "model.norm" in bad, (p["logits"], p["activations"]["model.norm"])
    assert any(n in bad for n in p["grads"]), "no gradient noticed"


def test_an_fla_activation_without_a_counterpart_is_an_error():
    from tests.support import fla_interpret as F
    assert F.counterpart("model.layers.1.mlp_norm[1]", "gdn", 2) == ("model.layers.3.norm.add_and_normalise[1]", None)
    assert F.counterpart("model.layers.1[0]", "kda", 2) == ("model.norm.add_and_normalise[1]", None)
    assert F.counterpart("model.layers.0[0]", "kda", 2) == ("model.layers.2.norm.add_and_normalise[1]", None)
    assert F.counterpart("model.layers.0.attn.g_proj", "gdn", 2) == ("model.layers.0.mixer.g_proj", None)
    assert F.counterpart("model.layers.0.attn.g_proj", "kda", 2) == ("model.layers.0.mixer.g_proj.1", None)
    key, reason = F.counterpart("model.layers.0.attn.k_conv1d[0]", "kda", 2)
    assert key is None and "run_short_conv" in reason
    for name in ("model.layers.0.attn.new_proj", "model.layers.0.attn[1]", "model.final_norm"):
        with pytest.raises(KeyError, match="no counterpart"):
            F.counterpart(name, "gdn", 2)
