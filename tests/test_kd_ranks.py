"""The KD stage (`upcycle kd`) on 2 gloo ranks against 1 rank at the same global batch, and a 2-rank run stopped by
SIGTERM resumed on 1 rank (CPU, tiny random teacher -> `upcycle init` -> kd).

Every run uses micro_batch_size 1: the KD loss is a token mean per micro-batch and the engine averages the
micro-batches, so a global batch split into micro-batches of one example gives the same mean of per-example
means whether the examples sit on one rank (gradient accumulation 2) or on two (accumulation 1). Micro-batches of
two examples on 1 rank against one example on each of 2 ranks weigh the examples differently (a token mean over
the pair against the mean of the two token means) and are not expected to agree.

Validation: ``data.val_max_batches`` counts global batches of ``micro_batch_size * world_size`` leading examples
(hybridlm/data/sampler.py ``validation_indices``), so 1 rank with 4 batches and 2 ranks with 2 batches evaluate
the same 4 examples; the validation loss is a token-weighted mean, equal however they are split.
"""
import json
import socket
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import REPO, demo_file, subprocess_env
from hybridlm.model import HybridForCausalLM

pytestmark = pytest.mark.slow  # ~55 s: three launches of two ranks and the students they share

STEPS, TERM_AT = 4, 2
REL = 1e-5  # fp32: the runs differ only in the order of the gradient sums


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kd_argv(tmp, out, val_batches):
    return ["kd", "--config", "configs/upcycle/smollm2_kd_cpu.yaml", f"teacher.path={tmp / 'teacher'}",
            f"student.path={tmp / 'init' / 'mamba2_student'}", "data.path=asset:alpaca_en_demo",
            "data.max_length=48", f"data.val_max_batches={val_batches}", f"optim.max_steps={STEPS}",
            "optim.micro_batch_size=1", "optim.global_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-3",
            "optim.precision=fp32", "run.eval_interval=2", "run.save_interval=100", "run.progress=false",
            f"run.output_dir={out}", "kd.ce_weight=0.5", "kd.chunk_tokens=32"]


def launch(argv, ranks, **env):
    if ranks == 1:
        cmd = [sys.executable, "-m", "upcycle.cli", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "upcycle.cli", *argv]
    return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(OMP_NUM_THREADS="1", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, want=0):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == want, (proc.returncode, out[-2000:], err[-4000:])
    return out, err


def rows(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out):
    return [(r["step"], r["loss"], r["kl"], r["ce"], r["tokens"]) for r in rows(out) if "loss" in r]


def val_losses(out):
    return [(r["step"], r["val_loss"]) for r in rows(out) if "val_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny random Llama teacher and its `upcycle init` student; KD of it on 1 rank, on 2 ranks, and on 2 ranks
    stopped by SIGTERM after step 2 then resumed on 1 rank."""
    demo_file("alpaca_en_demo.json")
    from hybridlm.data import load_tokenizer
    tmp = tmp_path_factory.mktemp("kd_ranks")
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tok), tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(tmp / "teacher")
    tok.save_pretrained(tmp / "teacher")
    finish(launch(["init", "--teacher", str(tmp / "teacher"), "--out", str(tmp / "init"), "--kv-lora-rank", "32",
                   "--qk-rope-head-dim", "8", "--calib-tokens", "0"], 1))
    one = launch(kd_argv(tmp, tmp / "one", 4), 1)
    two = launch(kd_argv(tmp, tmp / "two", 2), 2)
    finish(one)
    finish(two)
    # each rank SIGTERMs itself after step 2; the ranks save the checkpoint together and exit 143, torchrun exits
    # 1 (it may SIGTERM a rank still shutting down once the other has exited: the save's last barrier is passed)
    stopped = launch(kd_argv(tmp, tmp / "stopped", 2), 2, HYBRIDLM_FAULT_TERM_AT_STEP=str(TERM_AT))
    s_out, s_err = stopped.communicate(timeout=600)
    assert stopped.returncode != 0, s_out[-2000:]
    manifests = sorted((tmp / "stopped" / "checkpoints").glob("*/manifest.json"))
    saved = [json.loads(m.read_text()) for m in manifests]
    assert [(m["step"], m["world_size"]) for m in saved] == [(TERM_AT, 2)], saved
    # 1 rank: 4 validation batches of one example are the 2-rank run's 2 batches of two
    resumed_out, _ = finish(launch(kd_argv(tmp, tmp / "stopped", 4), 1))
    return {"tmp": tmp, "stopped_log": s_out + s_err, "resumed_log": resumed_out}


def weights(path):
    return HybridForCausalLM.from_pretrained(path).state_dict()


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        scale = wa[k].abs().max().item() or 1.0
        assert (wa[k] - wb[k]).abs().max().item() <= REL * scale + 1e-7, k


def assert_same_losses(got, want):
    assert [r[0] for r in got] == [r[0] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g[1:4] == pytest.approx(w[1:4], rel=REL), (g, w)
        assert g[4] == w[4]  # supervised tokens: the same examples in every global batch


@pytest.mark.timeout(900)
def test_kd_on_two_ranks_equals_one_rank_at_the_same_global_batch(runs):
    tmp = runs["tmp"]
    one, two = losses(tmp / "one"), losses(tmp / "two")
    assert_same_losses(two, one)
    assert one[-1][1] < one[0][1]  # it trains
    v1, v2 = val_losses(tmp / "one"), val_losses(tmp / "two")
    assert [s for s, _ in v1] == [s for s, _ in v2] == [2, 4]
    assert [v for _, v in v2] == pytest.approx([v for _, v in v1], rel=REL)
    r1 = json.loads((tmp / "one" / "final" / "stage.json").read_text())
    r2 = json.loads((tmp / "two" / "final" / "stage.json").read_text())
    assert r1["steps"] == r2["steps"] == STEPS and r1["tokens"] == r2["tokens"]
    assert_same_weights(tmp / "one" / "final", tmp / "two" / "final")


@pytest.mark.timeout(900)
def test_kd_stopped_by_sigterm_on_two_ranks_resumes_on_one_rank(runs):
    tmp = runs["tmp"]
    assert f"at step {TERM_AT} of {STEPS}" in runs["stopped_log"]
    resumed = losses(tmp / "stopped")
    assert_same_losses(resumed, losses(tmp / "one"))
    assert [s for s, _ in val_losses(tmp / "stopped")] == [2, 4]
    assert [v for _, v in val_losses(tmp / "stopped")] == pytest.approx([v for _, v in val_losses(tmp / "one")],
                                                                         rel=REL)
    assert_same_weights(tmp / "stopped" / "final", tmp / "one" / "final")
    assert not (tmp / "stopped" / "checkpoints").exists() or not any((tmp / "stopped" / "checkpoints").iterdir())
