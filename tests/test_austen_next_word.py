"""The local generate_until task ``austen_next_word``: built from the same items as ``austen_cloze`` (real Jane
Austen text), loaded by lm-evaluation-harness as a generation task, and run end to end on a tiny hybrid."""
import json
import os

import pytest
import torch

from conftest import tiny_config


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    from hybridlm.eval.build_tasks import build_austen_cloze, build_austen_next_word
    root = tmp_path_factory.mktemp("tasks")
    build_austen_cloze(root)
    build_austen_next_word(root)
    return root


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_items_are_the_cloze_items_with_their_answer(tasks):
    cloze = read_jsonl(tasks / "austen_cloze" / "austen_cloze.jsonl")
    gen = read_jsonl(tasks / "austen_next_word" / "austen_next_word.jsonl")
    assert len(gen) == 500
    for c, g in zip(cloze, gen):
        assert g == {**c, "answer": c["choices"][c["label"]]}
        assert g["answer"].isalpha() and g["answer"].islower()
    text = (tasks / "austen_next_word" / "austen_next_word.yaml").read_text()
    assert "output_type: generate_until" in text and "metric: exact_match" in text
    assert str(tasks / "austen_next_word" / "austen_next_word.jsonl") in text


def test_harness_loads_it_as_a_generation_task(tasks):
    if not os.environ.get("CI"):
        pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install -e '.[test]')")
    from lm_eval.tasks import TaskManager, get_task_dict
    manager = TaskManager(include_path=[str(tasks)], include_defaults=False)
    assert {"austen_cloze", "austen_next_word"} <= set(manager.all_tasks)
    task = get_task_dict(["austen_next_word"], manager)["austen_next_word"]
    assert task.OUTPUT_TYPE == "generate_until"
    doc = next(iter(task.test_docs()))
    assert task.doc_to_text(doc) == doc["context"] and task.doc_to_target(doc) == doc["answer"]
    kwargs = task.config.generation_kwargs
    assert kwargs["do_sample"] is False and kwargs["max_gen_toks"] == 8 and "." in kwargs["until"]
    # the filter keeps the first word of a generation; exact_match ignores case
    a = doc["answer"]
    resps = [[f" {a.capitalize()}"], ["\n"], [f" {a}ly"], [f"  {a}"]]
    for f in task._filters[0].filters:
        resps = f().apply(resps, [doc] * len(resps))
    firsts = list(resps)
    assert firsts == [a.capitalize(), "[invalid]", f"{a}ly", a]
    assert [task.process_results(doc, [r])["exact_match"] for r in firsts] == [1.0, 0.0, 0.0, 1.0]


def test_harness_runs_it_on_a_tiny_hybrid(tasks, tmp_path, capsys):
    if not os.environ.get("CI"):
        pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install -e '.[test]')")
    from hybridlm.data import load_tokenizer
    from hybridlm.eval.cli import main
    from hybridlm.model import HybridForCausalLM
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    HybridForCausalLM(tiny_config(vocab_size=len(tok))).save_pretrained(tmp_path / "hybrid")
    tok.save_pretrained(tmp_path / "hybrid")
    rc = main(["lm-eval", "--model", str(tmp_path / "hybrid"), "--tasks", "austen_next_word", "--include-path",
               str(tasks), "--limit", "3", "--batch-size", "3", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["n_samples"]["austen_next_word"] == {"original": 500, "effective": 3}
    metrics = res["tasks"]["austen_next_word"]
    assert any(k.startswith("exact_match") for k in metrics), metrics
    assert all(0.0 <= v <= 1.0 for k, v in metrics.items() if k.startswith("exact_match") and "stderr" not in k)
