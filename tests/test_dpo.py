"""DPO loss against trl 1.16's DPOTrainer, sequence log-probs, and the preference data loaders.

How the trl comparison is done: a real ``trl.DPOTrainer`` is built once (tiny random float64 Llama
policy + an explicit, differently initialised ``ref_model``, the real Llama-3.2 tokenizer, no hub
access). Its own loss code, ``DPOTrainer.compute_loss`` -> ``_compute_loss``, is then run

* on a chosen batch of log-probs: policy and reference are stand-in modules that return trl's
  ``FusedCausalLMOutput`` holding given per-token log-probs (what trl's fused LM head returns), so trl
  sums them over the completion mask itself; and
* end to end on real models and a batch built by ``tokenize_pair`` + ``collate_pairs``: trl computes
  log-probs with its fused LM head, we with ``sequence_logps`` on the models' ordinary logits.

In both, the loss and the six reward / logp metrics trl logs (``trainer._metrics["train"]``) must equal
``dpo_loss``'s to 1e-6 (absolute on given log-probs; relative end to end, where trl's fused head sums
log-softmax in float32). trl's own tokenization of the same pairs is compared with ``tokenize_pair`` too.
"""
import json

import pytest
import torch

from distill import (METRIC_KEYS, PreferencePair, collate_pairs, dpo_loss, load_preference_data, normalize_record,
                     render_texts, sequence_logps, tokenize_pair)
from hybridlm.config.errors import ConfigError
from conftest import demo_file

TOL = 1e-6

SHORT_PAIRS = [
    PreferencePair([{"role": "user", "content": "What is the capital of France?"}],
                   "The capital of France is Paris.", "France has no capital, it is a city."),
    PreferencePair([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"}],
                   "Four.", "Two plus two is twenty-two, obviously."),
    PreferencePair([{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another one?"}], "Green.", "No."),
    PreferencePair([{"role": "user", "content": "Say hello"}], "\nHello!", " Bye"),  # odd leading whitespace
]


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok():
    from hybridlm.data.assets import load_tokenizer
    return load_tokenizer("asset:llama3.2")


def tiny_llama(vocab, seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():  # a larger init so that policy and reference log-probs differ by O(1) per token
        model.model.embed_tokens.weight.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def trainer(tok, tmp_path_factory):
    """A real trl DPOTrainer; its dataset holds our rendered texts so trl tokenizes the same strings."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = []
    for pair in SHORT_PAIRS:
        t = render_texts(tok, pair)
        assert t["prompt_chosen"].startswith(t["prompt"]) and t["prompt_rejected"].startswith(t["prompt"])
        rows.append(dict(prompt=t["prompt"], chosen=t["prompt_chosen"][len(t["prompt"]):],
                         rejected=t["prompt_rejected"][len(t["prompt"]):]))
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("dpo-trainer")), beta=0.1, report_to="none", use_cpu=True,
                     bf16=False, gradient_checkpointing=False, max_length=None, per_device_train_batch_size=2,
                     save_strategy="no", loss_type="sigmoid")
    tr = DPOTrainer(model=tiny_llama(len(tok), 0), ref_model=tiny_llama(len(tok), 1), args=args,
                    train_dataset=Dataset.from_list(rows), processing_class=tok)
    tr.model.train()
    return tr


class FusedStub(torch.nn.Module):
    """Stands in for a model patched by trl's ``add_fused_lm_head``: returns given per-token log-probs."""

    def __init__(self, per_token):
        super().__init__()
        self.per_token = per_token

    def forward(self, input_ids=None, labels=None, fused_lm_head=False, **kwargs):
        from trl.trainer.utils import FusedCausalLMOutput
        assert fused_lm_head
        mask = labels[:, 1:] != -100
        lp = self.per_token * mask  # trl's contract: zero where the label is -100
        zeros = torch.zeros_like(lp)
        return FusedCausalLMOutput(loss=-lp.sum(), log_probs=lp, entropy=zeros, mean_logits=zeros,
                                   is_top1=torch.zeros_like(mask), label_mask=mask)


def trl_loss_and_metrics(trainer, model, inputs):
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(model, inputs)
    return loss, {k: trainer._metrics["train"][k][-1] for k in METRIC_KEYS}


# -------------------------------------------------------------------------------- (a) against trl
@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_metrics_match_trl_on_given_logps(trainer, monkeypatch, beta, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 12
    input_ids = torch.randint(0, 1000, (2 * B, T), generator=g)
    prompt_len = torch.randint(2, 6, (2 * B,), generator=g)
    total_len = prompt_len + torch.randint(1, T - 5, (2 * B,), generator=g)
    pos = torch.arange(T)
    completion_mask = ((pos >= prompt_len[:, None]) & (pos < total_len[:, None])).long()
    attention_mask = (pos < total_len[:, None]).long()
    shift = completion_mask[:, 1:].double()
    policy_tok = -torch.rand(2 * B, T - 1, generator=g, dtype=torch.float64) * 6
    ref_tok = -torch.rand(2 * B, T - 1, generator=g, dtype=torch.float64) * 6
    monkeypatch.setattr(trainer, "beta", beta)
    monkeypatch.setattr(trainer, "ref_model", FusedStub(ref_tok))
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask)
    trl_loss, trl_metrics = trl_loss_and_metrics(trainer, FusedStub(policy_tok), inputs)

    pol = (policy_tok * shift).sum(1)
    ref = (ref_tok * shift).sum(1)
    loss, metrics = dpo_loss(pol[:B], pol[B:], ref[:B], ref[B:], beta)
    assert abs(loss.item() - trl_loss.item()) < TOL
    for k in METRIC_KEYS:
        assert abs(metrics[k] - trl_metrics[k]) < TOL, k
    assert 0.0 < metrics["rewards/accuracies"] < 1.0 or B < 3  # a mixed batch: the accuracy is informative


def test_loss_and_metrics_match_trl_end_to_end(trainer, tok):
    feats = [tokenize_pair(tok, p) for p in SHORT_PAIRS]
    batch = collate_pairs(feats, tok.pad_token_id)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  completion_mask=(batch["labels"] != -100).long())
    model, ref = trainer.model, trainer.ref_model
    trl_loss, trl_metrics = trl_loss_and_metrics(trainer, model, inputs)

    B = len(feats)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with torch.no_grad():
        ref_logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    pol = sequence_logps(logits, batch["labels"])
    refl = sequence_logps(ref_logits, batch["labels"])
    loss, metrics = dpo_loss(pol[:B], pol[B:], refl[:B], refl[B:], trainer.beta)
    # trl's fused LM head accumulates log-softmax in float32 whatever the model dtype, so sequence sums
    # of ~-90 nats carry ~1e-6 absolute rounding: compare to 1e-6 relative here (the exact 1e-6 absolute
    # check of the loss formula is the given-log-probs test above).
    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    for k in METRIC_KEYS:
        assert metrics[k] == pytest.approx(trl_metrics[k], rel=TOL, abs=TOL), k
    assert abs(metrics["rewards/margins"]) > 1e-3  # policy and reference really differ
    # gradients agree as well
    model.zero_grad()
    trl_loss.backward()
    g_trl = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    pol2 = sequence_logps(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                          batch["labels"])
    dpo_loss(pol2[:B], pol2[B:], refl[:B], refl[B:], trainer.beta)[0].backward()
    g = model.model.embed_tokens.weight.grad
    assert (g - g_trl).abs().max() <= 1e-5 * g_trl.abs().max() and g_trl.abs().max() > 0
    model.zero_grad()


def test_tokenization_matches_trl(trainer, tok):
    """Untruncated, tokenize_pair splits prompt / answers exactly where trl's own tokenization does."""
    for pair, row in zip(SHORT_PAIRS, trainer.train_dataset):
        ours = tokenize_pair(tok, pair)
        n = ours["prompt_length"]
        assert ours["chosen_input_ids"][:n] == row["prompt_ids"]
        assert ours["chosen_input_ids"][n:] == row["chosen_ids"]
        assert ours["rejected_input_ids"][n:] == row["rejected_ids"]


# ------------------------------------------------------------------------------ (b) sequence_logps
def test_sequence_logps_matches_manual_gather():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 1, 6], [-100, 2, 4, -100, -100]])
    got = sequence_logps(logits, labels)
    logp = torch.log_softmax(logits, dim=-1)
    want = torch.stack([logp[0, 1, 3] + logp[0, 2, 1] + logp[0, 3, 6], logp[1, 0, 2] + logp[1, 1, 4]])
    assert torch.allclose(got, want, atol=1e-6)
    mask = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]])  # drop label 1 at position 3 of row 0
    want0 = logp[0, 1, 3] + logp[0, 3, 6]
    assert torch.allclose(sequence_logps(logits, labels, mask)[0], want0, atol=1e-6)
    assert sequence_logps(logits.bfloat16(), labels).dtype == torch.float32
    with pytest.raises(ValueError):
        sequence_logps(logits, labels[:, :4])


def test_dpo_loss_basic_values():
    z = torch.zeros(3)
    loss, m = dpo_loss(z, z, z, z, 0.1)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item())
    assert m["rewards/accuracies"] == 0.0 and m["rewards/margins"] == 0.0
    pc = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, m = dpo_loss(pc, torch.tensor([-3.0, -1.0]), torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]), 0.5)
    assert m["rewards/chosen"] == pytest.approx(0.25) and m["rewards/rejected"] == pytest.approx(0.0)
    assert m["rewards/accuracies"] == 0.5 and m["logps/chosen"] == -1.5
    loss.backward()
    assert (pc.grad < 0).all()  # raising the chosen log-prob lowers the loss
    with pytest.raises(ConfigError, match="beta"):
        dpo_loss(z, z, z, z, 0.0)


# ---------------------------------------------------------------------------------- (c) data
def write(path, records, jsonl=False):
    text = "\n".join(json.dumps(r) for r in records) + "\n" if jsonl else json.dumps(records)
    path.write_text(text, encoding="utf-8")
    return path


def test_three_formats_normalise_alike(tmp_path):
    system, q1, a1, q2 = "Be nice.", "Hi?", "Hello.", "And now?"
    plain = {"prompt": q1, "chosen": "Good", "rejected": "Bad"}
    chat = {"chosen": [{"role": "system", "content": system}, {"role": "user", "content": q1},
                       {"role": "assistant", "content": a1}, {"role": "user", "content": q2},
                       {"role": "assistant", "content": "Good"}],
            "rejected": [{"role": "system", "content": system}, {"role": "user", "content": q1},
                         {"role": "assistant", "content": a1}, {"role": "user", "content": q2},
                         {"role": "assistant", "content": "Bad"}]}
    sharegpt = {"conversations": [{"from": "system", "value": system}, {"from": "human", "value": q1},
                                  {"from": "gpt", "value": a1}, {"from": "human", "value": q2}],
                "chosen": {"from": "gpt", "value": "Good"}, "rejected": {"from": "gpt", "value": "Bad"}}
    explicit = {"prompt": chat["chosen"][:2], "chosen": chat["chosen"][2:], "rejected": chat["rejected"][2:]}
    want = PreferencePair(chat["chosen"][:4], "Good", "Bad")
    for rec in (chat, sharegpt, explicit):
        assert normalize_record(rec) == want
    assert normalize_record(plain) == PreferencePair([{"role": "user", "content": q1}], "Good", "Bad")
    assert normalize_record({**sharegpt, "conversations": sharegpt["conversations"][1:], "system": system}) == want
    # files: .json list and .jsonl lines, formats mixed
    for jsonl in (False, True):
        f = write(tmp_path / ("d.jsonl" if jsonl else "d.json"), [chat, sharegpt, explicit, plain], jsonl)
        pairs = load_preference_data(f)
        assert pairs[:3] == [want] * 3 and pairs[3].chosen == "Good"


def test_malformed_records_name_file_and_index(tmp_path):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    cases = [
        ({"prompt": "q", "chosen": "a"}, "record 1: missing field 'rejected'"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "record 1: prompt: expected a string"),
        ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
         "record 1: chosen / rejected: the messages before the answers must be the same"),
        ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "q"}]},
         "record 1: chosen: the last message must be the assistant's answer"),
        ({"conversations": [{"from": "bot", "value": "q"}], "chosen": {"from": "gpt", "value": "a"},
          "rejected": {"from": "gpt", "value": "b"}}, r"record 1: conversations\[0\]: 'from' must be one of"),
        ({"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "human", "value": "a"},
          "rejected": {"from": "gpt", "value": "b"}}, "record 1: chosen: the answer must come from the assistant"),
        ({"conversations": [], "chosen": "a", "rejected": "b"}, "record 1: conversations: expected a non-empty"),
        (["not", "an", "object"], "record 1: expected a JSON object"),
    ]
    for bad, msg in cases:
        f = write(tmp_path / "bad.json", [good, bad])
        with pytest.raises(ConfigError, match=msg) as e:
            load_preference_data(f)
        assert str(f) in str(e.value)
    f = write(tmp_path / "bad.jsonl", [good, good, {"prompt": "q"}], jsonl=True)
    with pytest.raises(ConfigError, match=r"bad.jsonl: record 2 \(line 3\): missing field 'chosen'"):
        load_preference_data(f)
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(ConfigError, match="broken.json: not valid JSON"):
        load_preference_data(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="not found"):
        load_preference_data(tmp_path / "missing.json")


def test_real_dpo_demo_loads_and_tokenizes(tok):
    demo = demo_file("dpo_en_demo.json")
    pairs = load_preference_data(demo)
    assert len(pairs) == 300
    raw = json.loads(demo.read_text(encoding="utf-8"))
    for pair, rec in zip(pairs, raw):
        assert pair.chosen == rec["chosen"]["value"] and pair.rejected == rec["rejected"]["value"]
        assert [m["content"] for m in pair.prompt_messages] == [t["value"] for t in rec["conversations"]]
        assert pair.prompt_messages[-1]["role"] == "user"
    assert any(p.prompt_messages[0]["role"] == "system" for p in pairs)
    assert any(sum(m["role"] == "assistant" for m in p.prompt_messages) >= 3 for p in pairs)  # multi-turn

    eos = tok.eos_token_id
    for pair in pairs:
        out = tokenize_pair(tok, pair)  # the recipe's limits: 1024 / 512
        n = out["prompt_length"]
        assert n <= 512
        for key, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            ids, labels = out[f"{key}_input_ids"], out[f"{key}_labels"]
            assert len(ids) == len(labels) <= 1024
            assert labels[:n] == [-100] * n and all(x != -100 for x in labels[n:])
            assert labels[n:] == ids[n:]
            if len(ids) < 1024:  # untruncated: the completion tokens are exactly the answer + eos
                assert ids[-1] == eos
                assert tok.decode(ids[n:-1]).strip() == answer.strip()
        assert out["chosen_input_ids"][:n] == out["rejected_input_ids"][:n]


def test_masks_and_fallback_format(tok):
    pair = SHORT_PAIRS[1]
    out = tokenize_pair(tok, pair)
    n = out["prompt_length"]
    text = tok.decode(out["chosen_input_ids"])
    assert text == "<|begin_of_text|>System: Be brief.\nUser: Two plus two?\nAssistant: Four.<|end_of_text|>"
    assert tok.decode(out["chosen_input_ids"][:n]) == "<|begin_of_text|>System: Be brief.\nUser: Two plus two?\nAssistant:"
    assert tok.decode([t for t in out["chosen_labels"] if t != -100]) == " Four.<|end_of_text|>"
    assert tok.decode([t for t in out["rejected_labels"] if t != -100]) == \
        " Two plus two is twenty-two, obviously.<|end_of_text|>"


def test_truncation_respects_limits(tok):
    long_q = " ".join(f"word{i}" for i in range(400))
    long_a = " ".join(f"ans{i}" for i in range(400))
    pair = PreferencePair([{"role": "user", "content": long_q}], long_a, "short")
    full = tokenize_pair(tok, pair, max_length=100000, max_prompt_length=99999)
    out = tokenize_pair(tok, pair, max_length=128, max_prompt_length=48)
    n = out["prompt_length"]
    assert 44 <= n <= 48  # content cut on its own tokens, the prompt re-rendered and re-tokenized
    prompt = tok.decode(out["chosen_input_ids"][:n])
    assert out["chosen_input_ids"][0] == tok.bos_token_id  # bos kept (the plain format's own)
    assert prompt.startswith("<|begin_of_text|>User: ") and prompt.endswith(" word399\nAssistant:")
    assert long_q.endswith(prompt[len("<|begin_of_text|>User: "):-len("\nAssistant:")])  # the content's end survives
    assert len(out["chosen_input_ids"]) == 128  # the long answer is cut from the right to fit
    assert out["chosen_input_ids"][n:] == full["chosen_input_ids"][full["prompt_length"]:][:128 - n]
    assert out["rejected_input_ids"][n:] == full["rejected_input_ids"][full["prompt_length"]:]  # short: kept whole
    assert sum(t != -100 for t in out["chosen_labels"]) == 128 - n
    short = tokenize_pair(tok, SHORT_PAIRS[0], max_length=1024, max_prompt_length=512)
    assert short == tokenize_pair(tok, SHORT_PAIRS[0], max_length=100000, max_prompt_length=99999)  # nothing cut
    with pytest.raises(ConfigError, match="max_prompt_length"):
        tokenize_pair(tok, pair, max_length=64, max_prompt_length=64)
    with pytest.raises(ConfigError, match="max_length"):
        tokenize_pair(tok, pair, max_length=0, max_prompt_length=64)
    with pytest.raises(ConfigError, match="cannot hold this prompt's chat template"):
        tokenize_pair(tok, pair, max_length=64, max_prompt_length=3)


def test_chat_template_path(tok):
    """A tokenizer with a chat template: its rendering is used, no extra eos, prompt masked."""
    import copy
    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                       "{{ m['content'] }}<|eot_id|>{% endfor %}"
                       "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    out = tokenize_pair(t, SHORT_PAIRS[0])
    n = out["prompt_length"]
    assert t.decode(out["chosen_input_ids"][n:]) == "The capital of France is Paris.<|eot_id|>"
    assert t.decode(out["chosen_input_ids"][:n]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert out["chosen_input_ids"][0] != t.bos_token_id  # the template did not write a bos; none added
    for side in ("chosen", "rejected"):  # the prompt is masked out of the loss, the answer is not
        ids, labels = out[f"{side}_input_ids"], out[f"{side}_labels"]
        assert labels[:n] == [-100] * n and labels[n:] == ids[n:] and len(labels) == len(ids) > n


def test_collate_pairs_layout(tok):
    feats = [tokenize_pair(tok, p) for p in SHORT_PAIRS[:2]]
    b = collate_pairs(feats, tok.pad_token_id)
    assert b["input_ids"].shape[0] == 4
    assert b["input_ids"][0, :len(feats[0]["chosen_input_ids"])].tolist() == feats[0]["chosen_input_ids"]
    assert b["labels"][3, :len(feats[1]["rejected_labels"])].tolist() == feats[1]["rejected_labels"]
    assert (b["labels"][b["attention_mask"] == 0] == -100).all()
