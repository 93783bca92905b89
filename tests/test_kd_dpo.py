"""KD-SFT loss, chat SFT data and batches, and the ``kd`` / ``dpo`` stages end to end (CPU, tiny models)."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import REPO, demo_file, tiny_config, subprocess_env
from distill.kd import KDConfig
from distill.kd_loss import kd_loss
from distill.preference_data import PreferencePair, tokenize_pair
from hybridlm.config.errors import ConfigError
from hybridlm.data.sft import (SFTBatches, SFTDataConfig, collate_sft, load_sft_data, normalize_conversation,
                               sft_validation_batches, tokenize_conversation)
from hybridlm.model import HybridForCausalLM

ALPACA = "asset:alpaca_en_demo"  # the configs name the record files by asset
DPO_DEMO = "asset:dpo_en_demo"


def tiny_llama(seed, hidden=48, vocab=512, **kw):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab, tie_word_embeddings=True, **kw)
    return LlamaForCausalLM(cfg)


def reference_kd(student, teacher, ids, labels, temperature, ce_weight):
    """KD loss from the full logits, the textbook way (mask by shifted labels)."""
    s = student(input_ids=ids).logits[:, :-1].float()
    with torch.no_grad():
        t = teacher(input_ids=ids).logits[:, :-1].float()
    y = labels[:, 1:]
    m = y != -100
    kl = F.kl_div(F.log_softmax(s[m] / temperature, -1), F.log_softmax(t[m] / temperature, -1),
                  log_target=True, reduction="none").sum(-1).mean()
    ce = F.cross_entropy(s[m], y[m])
    return kl + ce_weight * ce, kl, ce, int(m.sum())


# --------------------------------------------------------------------------------------- kd_loss
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.0, 0.5)])
def test_kd_loss_equals_full_logits_kl_for_any_chunk_size(temperature, ce_weight):
    """A hybrid student (mamba2 + MLA) against a wider Llama teacher: the chunked loss, its metrics and its
    gradients equal the direct full-logits computation, for every chunk size."""
    teacher = tiny_llama(0, hidden=48).eval()
    torch.manual_seed(1)
    student = HybridForCausalLM(tiny_config(pattern="*-M-", mixer="mamba2"))
    ids = torch.randint(0, 512, (3, 19))
    labels = ids.clone()
    labels[:, :6] = -100  # prompt
    labels[1, 12:] = -100  # padding
    ref, kl, ce, n = reference_kd(student, teacher, ids, labels, temperature, ce_weight)
    ref.backward()
    want = [p.grad.clone() for p in student.parameters()]
    for chunk in (1, 7, 10_000):
        student.zero_grad()
        loss, metrics = kd_loss(student, teacher, {"input_ids": ids, "labels": labels}, 1.0, ce_weight,
                                temperature, chunk)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
        assert float(metrics["kl"]) == pytest.approx(kl.item(), rel=1e-5, abs=1e-7)
        assert float(metrics["ce"]) == pytest.approx(ce.item(), rel=1e-5)
        assert metrics["tokens"] == n == 3 * 18 - 3 * 5 - 7
        loss.backward()
        for p, g in zip(student.parameters(), want):
            assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in teacher.parameters())


def test_kd_loss_is_zero_when_student_is_teacher():
    model = tiny_llama(0)
    ids = torch.randint(0, 512, (2, 16))
    loss, metrics = kd_loss(model, model, {"input_ids": ids, "labels": ids}, chunk_tokens=5)
    assert abs(loss.item()) < 1e-6 and abs(float(metrics["kl"])) < 1e-6
    loss.backward()
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-6


def test_kd_config_rejects_bad_values():
    for bad in ({"kl_weight": -1.0}, {"kl_weight": 0.0, "ce_weight": 0.0}, {"temperature": 0.0},
                {"chunk_tokens": 0}):
        with pytest.raises(ConfigError):
            KDConfig(**bad).validate("kd")
    KDConfig().validate("kd")


# --------------------------------------------------------------------------------------- SFT data
def trained_spans(tok, example):
    spans, cur = [], []
    for i, lab in zip(example["input_ids"], example["labels"]):
        if lab != -100:
            assert lab == i
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "and more"}, {"role": "assistant", "content": "ok then"}]


@pytest.fixture(scope="module")
def llama_tok():
    from hybridlm.data import load_tokenizer
    return load_tokenizer("asset:llama3.2")


@pytest.fixture(scope="module")
def smol_tok():
    from hybridlm.teacher import load_teacher_tokenizer
    return load_teacher_tokenizer("asset:smollm2")  # fetched (~30 s) when not cached


def test_sft_plain_format_trains_only_assistant_tokens(llama_tok):
    assert not llama_tok.chat_template
    rec = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 + 3 = 5."}
    ex = tokenize_conversation(llama_tok, normalize_conversation(rec), 512)
    assert llama_tok.decode(ex["input_ids"]) == \
        "<|begin_of_text|>User: Add the numbers.\n2 and 3\nAssistant: 2 + 3 = 5.<|end_of_text|>"
    assert trained_spans(llama_tok, ex) == [" 2 + 3 = 5.<|end_of_text|>"]
    multi = tokenize_conversation(llama_tok, CHAT, 512)
    assert trained_spans(llama_tok, multi) == [" Hello there", " ok then<|end_of_text|>"]
    # the same conversation as DPO's chosen sequence: one tokenization for SFT and DPO
    pair = tokenize_pair(llama_tok, PreferencePair(CHAT[:3], "ok then", "no"))
    assert pair["chosen_input_ids"] == multi["input_ids"]
    assert pair["chosen_labels"][pair["prompt_length"]:] == multi["labels"][pair["prompt_length"]:]


def test_sft_truncation_and_dropping(llama_tok):
    ex = tokenize_conversation(llama_tok, CHAT, 9)
    assert len(ex["input_ids"]) == 9 and ex["labels"][-1] != -100
    long_prompt = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]
    assert tokenize_conversation(llama_tok, long_prompt, 20) is None


def test_sft_chat_template_trains_every_assistant_turn(smol_tok):
    assert smol_tok.chat_template
    ex = tokenize_conversation(smol_tok, CHAT, 512)
    text = smol_tok.decode(ex["input_ids"])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\nok then<|im_end|>\n")
    assert trained_spans(smol_tok, ex) == ["Hello there<|im_end|>\n", "ok then<|im_end|>\n"]
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there"},
                                  {"from": "human", "value": "and more"}, {"from": "gpt", "value": "ok then"}]}
    assert tokenize_conversation(smol_tok, normalize_conversation(sharegpt), 512) == ex
    assert tokenize_conversation(smol_tok, normalize_conversation({"messages": CHAT}), 512) == ex


def test_sft_record_layouts_and_errors(tmp_path):
    assert normalize_conversation({"instruction": "q", "input": "", "output": "a", "system": "s"}) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    # trailing user turns are dropped: nothing after the last answer is trained
    assert normalize_conversation({"messages": CHAT + [{"role": "user", "content": "?"}]}) == CHAT
    for bad in ({"messages": [{"role": "user", "content": "only a question"}]}, {"text": "x"},
                {"conversations": [{"from": "robot", "value": "x"}]}, {"instruction": "q"}):
        with pytest.raises(ConfigError):
            normalize_conversation(bad)
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": CHAT}) + "\n\n" + json.dumps({"instruction": "q", "output": "a"}) + "\n")
    assert len(load_sft_data(f)) == 2
    f.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"oops": 1}) + "\n")
    with pytest.raises(ConfigError, match="record 1"):
        load_sft_data(f)
    assert len(load_sft_data(demo_file("alpaca_en_demo.json"))) == 999
    with pytest.raises(ConfigError, match="data.max_length"):
        SFTDataConfig(path="x.json", max_length=1).validate("data")


def _examples(n=11):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 3 + i % 5
        ids = torch.randint(1, 100, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def test_sft_batches_shard_pad_and_resume_identically():
    ex = _examples()
    a = SFTBatches(ex, 2, rank=0, world_size=1, seed=3, pad_id=0)
    first = [next(a) for _ in range(7)]  # 5 steps per epoch: crosses into epoch 1
    as_arrays = [{k: np.asarray(v, dtype=np.int32) for k, v in e.items()} for e in ex]
    arr = SFTBatches(as_arrays, 2, seed=3, pad_id=0)
    assert arr.state_dict() == SFTBatches(ex, 2, seed=3, pad_id=0).state_dict()  # same fingerprint
    got = next(arr)
    assert all(torch.equal(got[k], v) for k, v in first[0].items())
    b = first[0]
    assert b["input_ids"].shape[0] == 2 and (b["labels"][b["attention_mask"] == 0] == -100).all()
    fresh = SFTBatches(ex, 2, seed=3, pad_id=0)
    for _ in range(4):
        next(fresh)
    state = fresh.state_dict()
    resumed = SFTBatches(ex, 2, seed=3, pad_id=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for want in first[4:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)
    # two ranks of micro-batch 1 see exactly the single-rank micro-batch 2 examples
    r0, r1 = SFTBatches(ex, 1, 0, 2, seed=3, pad_id=0), SFTBatches(ex, 1, 1, 2, seed=3, pad_id=0)
    for want in first[:3]:
        rows = {tuple(x[m.bool()].tolist()) for x, m in zip(want["input_ids"], want["attention_mask"])}
        got = {tuple(next(r)["input_ids"][0].tolist()) for r in (r0, r1)}
        assert got == rows
    with pytest.raises(ConfigError, match="fingerprint"):
        SFTBatches(_examples(11)[::-1], 2, seed=3).load_state_dict(state)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        SFTBatches(ex, 6, 0, 2)
    val = sft_validation_batches(ex, 4, 2, rank=0, world_size=1)
    assert len(val) == 2 and torch.equal(val[0]["input_ids"], collate_sft(ex[:4], 0)["input_ids"])


# --------------------------------------------------------------------------------------- stages
DRIVER = """
import argparse, json, sys
from upcycle.stages import add_stage_commands
parser = argparse.ArgumentParser(prog="upcycle")
sub = parser.add_subparsers(dest="command", required=True)
add_stage_commands(sub)
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(argv)
    print("RESULT", json.dumps(args.fn(args)), flush=True)
"""


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """One tiny random Llama teacher -> `upcycle init` -> kd -> dpo (from the KD output) -> kd again (skipped:
    finished). Resuming is the shared loop's; the data iterator's part is test_sft_batches_*."""
    for name in ("alpaca_en_demo.json", "dpo_en_demo.json"):
        demo_file(name)
    from hybridlm.data import load_tokenizer
    tmp = tmp_path_factory.mktemp("kd_dpo")
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tok), tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    teacher = tmp / "teacher"
    LlamaForCausalLM(cfg).save_pretrained(teacher)
    tok.save_pretrained(teacher)
    env = subprocess_env()
    init = subprocess.run([sys.executable, "-m", "upcycle.cli", "init", "--teacher", str(teacher), "--out",
                           str(tmp / "init"), "--kv-lora-rank", "32", "--qk-rope-head-dim", "8",
                           "--calib-tokens", "0"],
                          cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-2000:]
    common = ["optim.micro_batch_size=2", "optim.global_batch_size=4", "optim.warmup_steps=0", "optim.lr=2e-3",
              "run.save_interval=2", "run.progress=false", "data.val_max_batches=2"]
    kd = ["kd", "--config", "configs/upcycle/smollm2_kd_cpu.yaml", f"teacher.path={teacher}",
          f"student.path={tmp / 'init' / 'mamba2_student'}", f"data.path={ALPACA}", "data.max_length=48",
          "optim.max_steps=4", "run.eval_interval=2", f"run.output_dir={tmp / 'kd'}", "kd.ce_weight=0.5",
          "kd.chunk_tokens=32"] + common
    dpo = ["dpo", "--config", "configs/upcycle/smollm2_dpo_cpu.yaml", f"student.path={tmp / 'kd' / 'final'}",
           f"data.path={DPO_DEMO}", "data.max_length=48", "data.max_prompt_length=24", "optim.max_steps=3",
           "data.val_fraction=0.03", "run.eval_interval=2", f"run.output_dir={tmp / 'dpo'}", "dpo.beta=0.5"] + common
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([kd, dpo, kd])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(l[len("RESULT "):]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    return {"tmp": tmp, "stdout": proc.stdout, "kd": results[0], "dpo": results[1], "kd_again": results[2]}


def _rows(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_kd_stage_trains_logs_kl_and_skips_when_done(stages):
    tmp, result = stages["tmp"], stages["kd"]
    assert result["steps"] == 4 and result["config"]["kd"]["ce_weight"] == 0.5
    assert json.loads((tmp / "kd" / "final" / "stage.json").read_text()) == result
    rows = [r for r in _rows(tmp / "kd" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["loss"] == pytest.approx(r["kl"] + 0.5 * r["ce"], rel=1e-4)
        assert 0 < r["tokens"] and r["kl"] > 0
    assert rows[-1]["loss"] < rows[0]["loss"]
    val = [r for r in _rows(tmp / "kd" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    assert not any("val_ppl" in r for r in val)  # exp(KL) is no perplexity
    student = HybridForCausalLM.from_pretrained(tmp / "kd" / "final")
    before = HybridForCausalLM.from_pretrained(tmp / "init" / "mamba2_student")
    assert not torch.equal(student.model.embed_tokens.weight, before.model.embed_tokens.weight)  # end to end
    assert not torch.equal(student.model.layers[0].mixer.in_proj.weight, before.model.layers[0].mixer.in_proj.weight)
    assert "kd: already finished" in stages["stdout"] and stages["kd_again"] == result


def test_dpo_stage_starts_at_log2_logs_rewards_and_reports_held_out_accuracy(stages):
    tmp, result = stages["tmp"], stages["dpo"]
    assert result["steps"] == 3 and result["reference"] == str(tmp / "kd" / "final")
    assert result["config"]["dpo"] == {"beta": 0.5}
    assert json.loads((tmp / "dpo" / "final" / "stage.json").read_text()) == result
    rows = _rows(tmp / "dpo" / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    first = train[0]
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert first[key] == pytest.approx(0.0, abs=1e-6) and all(key in r for r in train)
    assert train[-1]["rewards/margins"] != 0.0
    held_out = result["eval"]
    assert held_out["pairs"] == 4 and 0.0 <= held_out["rewards/accuracies"] <= 1.0  # 2 val batches of 2 pairs
    assert held_out["rewards/margins"] == pytest.approx(held_out["rewards/chosen"] - held_out["rewards/rejected"])
    # the loop's own final evaluation, logged by its logger: the loss and every metric, means over the pairs
    assert rows[-1]["step"] == 3 and rows[-1]["val_count"] == 4
    assert rows[-1]["val_loss"] == held_out["loss"] and rows[-1]["val_rewards/accuracies"] == held_out["rewards/accuracies"]
    assert result["teacher"] is None  # DPO has no teacher; its reference is the student's starting point
    assert all("/" not in k or k.split("/")[0] in ("rewards", "logps", "val_rewards", "val_logps") for r in rows for k in r)


def test_dpo_rejects_a_teacher_section():
    from distill.dpo_stage import DPO_SECTIONS, dpo_configs
    from hybridlm.config.loader import load_config
    with pytest.raises(ConfigError, match="unknown section 'teacher'"):
        load_config(str(REPO / "configs/upcycle/smollm2_dpo_cpu.yaml"), ["teacher.path=x"], sections=DPO_SECTIONS)
    with pytest.raises(ConfigError, match="DPO has no teacher"):
        dpo_configs({"teacher": {"path": "x"}, "student": {"path": "y"}, "data": {}, "optim": {}, "run": {}})
    with pytest.raises(ConfigError, match="dpo.beta"):
        dpo_configs({"dpo": {"beta": 0}})
