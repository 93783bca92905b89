"""The route report's generation scores (hybridlm.eval.generation_score) against a direct computation on tiny
models, the report's generation columns, and that the held-out prompts are absent from every training source of
the shipped upcycling configs."""
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from hybridlm.config.errors import ConfigError
from hybridlm.eval.generation_score import (PROMPT_SOURCE, GenerationScorer, check_prompt_source_heldout,
                                            heldout_prompts, leading_agreement, repeated_ngrams, training_sources)
from test_upcycle_init_mamba import tiny_llama, tiny_student

ROOT = Path(__file__).resolve().parents[1]
ROUTE_CONFIGS = sorted((ROOT / "configs" / "upcycle").glob("*.yaml"))


def direct_greedy(model, prompt, new):
    ids = prompt[None]
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def direct_nll(teacher, prompt, cont):
    ids = torch.tensor(prompt.tolist() + cont)[None]
    with torch.no_grad():
        logp = F.log_softmax(teacher(input_ids=ids).logits.double(), -1)[0]
    return [-logp[len(prompt) + i - 1, t].item() for i, t in enumerate(cont)]


def direct_repeats(seq, n=4):
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return sum(g in grams[:i] for i, g in enumerate(grams)), len(grams)


def test_ngram_and_agreement_definitions():
    assert repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4, 1]) == (2, 6)  # 1234 and 2341 recur; 3412, 4123 do not
    assert repeated_ngrams([5] * 10) == (6, 7)  # a loop: every 4-gram after the first
    assert repeated_ngrams([1, 2, 3]) == (0, 0)
    assert leading_agreement([1, 2, 3], [1, 2, 4]) == 2 and leading_agreement([7], [1]) == 0
    assert leading_agreement([1, 2], [1, 2]) == 2


def test_scores_match_direct_computation():
    teacher = tiny_llama(layers=2).float()
    student = tiny_student(teacher, ["mamba2", "mla"]).float()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 128, (5, 6), generator=g)  # 5 prompts in batches of 2: a partial last batch
    new = 12
    scorer = GenerationScorer(teacher, prompts, new_tokens=new, batch_size=2)
    got = scorer(student)
    own = scorer(teacher)

    t_conts = [direct_greedy(teacher, p, new) for p in prompts]
    s_conts = [direct_greedy(student, p, new) for p in prompts]
    assert scorer.teacher_conts.tolist() == t_conts
    t_nll = [x for p, c in zip(prompts, t_conts) for x in direct_nll(teacher, p, c)]
    s_nll = [x for p, c in zip(prompts, s_conts) for x in direct_nll(teacher, p, c)]
    t_mean, s_mean = sum(t_nll) / len(t_nll), sum(s_nll) / len(s_nll)
    reps = [direct_repeats(c) for c in s_conts]
    agree = [next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), new) for c, r in zip(s_conts, t_conts)]

    assert abs(got["gen_ppl"] - math.exp(s_mean)) < 1e-4 * math.exp(s_mean)
    assert abs(got["gen_ppl_ratio"] - math.exp(s_mean - t_mean)) < 1e-4
    assert got["gen_repeat4"] == sum(r for r, _ in reps) / sum(t for _, t in reps)
    assert got["gen_agree"] == sum(agree) / len(agree) < new  # the untrained student drifts from the teacher
    assert abs(own["gen_ppl"] - math.exp(t_mean)) < 1e-4 * math.exp(t_mean)
    assert own["gen_ppl_ratio"] == 1.0 and own["gen_agree"] == new
    with pytest.raises(ConfigError, match="generation_tokens"):
        GenerationScorer(teacher, prompts, new_tokens=3)


def test_report_columns():
    from upcycle.route_report import report_markdown
    row = {"ppl": 10.0, "kl": 0.1, "gen_ppl": 3.0, "gen_ppl_ratio": 1.5, "gen_repeat4": 0.25, "gen_agree": 7.5}
    report = {"heldout": {"a": {"text": "held-out docs", "seq_len": 32, "tokens": 256}},
              "targets": {"ppl_ratio": [1.25, 1.1]}, "stages": [],
              "perplexity": [{"model": "teacher", "tokens_trained": 0, **row, "gen_ppl_ratio": 1.0, "gen_agree": 64.0},
                             {"model": "after DPO", "tokens_trained": 10 ** 6, **row}],
              "generation": {"source": PROMPT_SOURCE, "prompts": 16, "prompt_tokens": 32, "new_tokens": 64,
                             "ngram": 4, "teacher_ppl": 2.0}}
    md = report_markdown(report)
    assert "| gen ppl | gen ppl ratio | repeat 4-gram | agree, tokens |" in md
    assert "| after DPO | 1,000,000 | 10.00 | 0.1000 | 3.000 | 1.500 | 0.250 | 7.5 |" in md
    assert "| teacher | 0 | 10.00 | 0.1000 | 3.000 | 1.000 | 0.250 | 64.0 |" in md
    head = md.splitlines()
    table = [ln for ln in head if ln.startswith("| model")][0]
    assert table.count("|") == head[head.index(table) + 1].count("|")  # the separator row has as many columns
    del report["generation"]
    assert "gen ppl" not in report_markdown(report)


def test_report_png(tmp_path):
    from upcycle.route_report import plot_report
    row = {"ppl": 10.0, "kl": 0.1, "gen_ppl": 3.0, "gen_ppl_ratio": 1.5, "gen_repeat4": 0.25, "gen_agree": 7.5}
    report = {"heldout": {"a": {"text": "held-out docs", "seq_len": 32, "tokens": 256}},
              "targets": {"ppl_ratio": [1.25, 1.1]}, "stages": [],
              "perplexity": [{"model": "teacher", "tokens_trained": 0, **row},
                             {"model": "after DPO", "tokens_trained": 10 ** 6, **row}],
              "generation": {"source": PROMPT_SOURCE, "prompts": 16, "prompt_tokens": 32, "new_tokens": 64,
                             "ngram": 4, "teacher_ppl": 2.0}}
    png = plot_report(report, tmp_path / "report.png")
    assert png.stat().st_size > 10000


# ------------------------------------------------------------------------------------ held out


def normalise(text):
    return re.sub(r"\s+", " ", text).strip()


def json_strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from json_strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from json_strings(x)


def source_text(spec):
    """All text of one training source: every string of a record set, every document of a corpus."""
    from hybridlm.data.assets import resolve_source
    from hybridlm.data.prepare import iter_documents
    path = Path(resolve_source(spec))
    if path.suffix in (".json", ".jsonl"):
        text = path.read_text(encoding="utf-8")
        recs = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
        return "\n".join(json_strings(recs))
    return "\n".join(iter_documents([spec]))


def test_route_configs_do_not_train_on_the_prompt_source():
    assert len(ROUTE_CONFIGS) >= 5
    for path in ROUTE_CONFIGS:
        cfg = yaml.safe_load(path.read_text())
        assert PROMPT_SOURCE not in training_sources(cfg), path
        check_prompt_source_heldout(cfg)
    h200 = yaml.safe_load((ROOT / "configs" / "upcycle" / "smollm2_route_h200.yaml").read_text())
    srcs = training_sources(h200)
    assert {"asset:janeausten", "asset:linuxdoc", "asset:alpaca_en_demo", "asset:dpo_en_demo"} <= set(srcs)
    h200["kd"]["data"] = {"path": PROMPT_SOURCE}
    with pytest.raises(ConfigError, match="would not be held out"):
        check_prompt_source_heldout(h200)


def test_prompts_absent_from_every_training_source():
    """The first 64 prompts (more than a report uses) do not occur, whitespace-normalised, in the text of any
    ``asset:`` source that a stage of configs/upcycle/*.yaml trains on. The other specs are local ``data_cache/``
    paths: packed directories built from the ``sources`` listed beside them, or files a user prepares (not present
    here, so not read)."""
    from hybridlm.data.assets import load_tokenizer
    tok = load_tokenizer("asset:llama3.2")
    prompts = [normalise(tok.decode(p)) for p in heldout_prompts(tok, 64, prompt_tokens=32).tolist()]
    assert len(set(prompts)) == 64 and all(len(p) > 60 for p in prompts)
    specs = set()
    for path in ROUTE_CONFIGS:
        for spec in training_sources(yaml.safe_load(path.read_text())):
            if spec.startswith("asset:"):
                specs.add(spec)
            else:
                assert spec.startswith(("data_cache/", "runs/")), (path, spec)
    assert len(specs) >= 12
    for spec in sorted(specs):
        text = normalise(source_text(spec))
        assert len(text) > 10000, spec
        hits = [p for p in prompts if p in text]
        assert not hits, (spec, hits[:2])
        # a shorter probe too: the first 12 words of each prompt
        heads = [" ".join(p.split()[:12]) for p in prompts]
        assert not [h for h in heads if h in text], spec


def test_route_report_writes_generation_columns(tmp_path):
    """``route_report(generation_prompts=3)`` on a route directory holding a tiny teacher and a tiny "after DPO"
    hybrid: the JSON rows hold the four scores, equal to a GenerationScorer run on the same prompts; the Markdown
    and the PNG carry them."""
    from conftest import assert_chart, save_tiny_llama, tiny_config
    from hybridlm.data import load_tokenizer
    from hybridlm.data.prepare import prepare
    from hybridlm.model import HybridForCausalLM
    from hybridlm.teacher import load_teacher
    from upcycle.route_report import route_report
    from hybridlm.data.record_sets import record_file

    tok = load_tokenizer("asset:llama3.2")
    teacher_dir = save_tiny_llama(tmp_path / "teacher", num_layers=2)
    route = tmp_path / "route"
    (route / "dpo" / "final").mkdir(parents=True)
    torch.manual_seed(0)
    HybridForCausalLM(tiny_config(vocab_size=len(tok))).save_pretrained(route / "dpo" / "final")
    (route / "route_config.json").write_text(json.dumps({"teacher": str(teacher_dir), "dpo": {"data": {"path": "asset:dpo_en_demo"}}}))
    docs = []
    for i, rec in enumerate(json.loads(record_file("alpaca_en_demo").read_text())[:2]):
        docs.append(tmp_path / f"doc{i}.txt")
        docs[-1].write_text(rec["output"] * 4)
    prepare([str(d) for d in docs], "asset:llama3.2", tmp_path / "packed", val_fraction=0.5, progress=False)

    report = route_report(route, tmp_path / "packed", seq_len=16, max_tokens=32, device=torch.device("cpu"),
                          generation_prompts=3, generation_tokens=6, generation_prompt_tokens=8)
    assert report["generation"] == {"source": PROMPT_SOURCE, "prompts": 3, "prompt_tokens": 8, "new_tokens": 6,
                                    "ngram": 4, "teacher_ppl": pytest.approx(report["perplexity"][0]["gen_ppl"])}
    rows = {r["model"]: r for r in report["perplexity"]}
    assert set(rows) == {"teacher", "after DPO"}
    teacher = load_teacher(str(teacher_dir)).float().eval()
    hybrid = HybridForCausalLM.from_pretrained(route / "dpo" / "final").float().eval()
    expect = GenerationScorer(teacher, heldout_prompts(load_tokenizer(str(teacher_dir)), 3, 8), 6)(hybrid)
    for key, value in expect.items():
        assert rows["after DPO"][key] == pytest.approx(value, rel=1e-5), key
    assert rows["teacher"]["gen_ppl_ratio"] == 1.0 and rows["teacher"]["gen_agree"] == 6
    saved = json.loads((route / "report.json").read_text())
    assert saved["perplexity"][1]["gen_repeat4"] == rows["after DPO"]["gen_repeat4"]
    md = (route / "report.md").read_text()
    assert "| gen ppl | gen ppl ratio | repeat 4-gram | agree, tokens |" in md and "3 held-out prompts" in md
    assert_chart(route / "report.png")
    with pytest.raises(ConfigError, match="generation_prompts"):
        route_report(route, tmp_path / "packed", seq_len=16, max_tokens=32, device=torch.device("cpu"),
                     generation_prompts=-1)
