"""``hybrid-eval ruler``: RULER-style items built from local text at a length in the model's tokens, scored by
RULER's string match; an oracle that reads the answer out of each prompt scores 1.0 through the same scoring."""
import json
import re
from collections import Counter

import pytest

from conftest import assert_chart, save_tiny_llama
from hybridlm.eval.cli import main
from hybridlm.eval.ruler import TASKS, build_items, load_haystack, score_items, string_match_all
from hybridlm.eval.ruler.tasks import NEEDLE, PromptRenderer, build_item, fwe_counts, resolve_tasks
from hybridlm.teacher import load_teacher_tokenizer

LENGTHS = (1024, 2048)


@pytest.fixture(scope="module")
def hay():
    return load_haystack(["asset:sotu"])


@pytest.fixture(scope="module")
def smol():
    return load_teacher_tokenizer("asset:smollm2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("ruler") / "tiny", num_layers=1)


@pytest.fixture(scope="module")
def items(hay, smol):
    return build_items(list(TASKS), LENGTHS, 2, hay, PromptRenderer(smol, chat=True), seed=0)


def task_text(prompt: str) -> str:
    """The user turn of a chat prompt (what the oracle may read: no answer is in the template or the prefix)."""
    return prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def oracle(item) -> str:
    """Solve the item from its prompt text alone: the needles of the asked keys, the variable chain of the asked
    value, the most repeated words of the last list, the most frequent coded words."""
    text = task_text(item.prompt)
    if item.task.startswith("niah"):
        question = text.rsplit("\n", 1)[1]
        asked = re.search(r"for (.+) mentioned in the provided text\?$", question).group(1)
        keys = re.split(r", and |, ", asked)
        found = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.(?:\n| |$)", text)
        return " ".join(v for k in keys for key, v in found if key == k)
    if item.task == "vt":
        body = text.rsplit("\n\n", 1)[1]
        value = re.search(r"assigned the value (\d+) in the text above", body).group(1)
        held = {}
        for name, src in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", body):
            held[name] = held[src[4:]] if src.startswith("VAR ") else src
        return " ".join(n for n, v in held.items() if v == value)
    if item.task == "cwe":
        listed = re.findall(r"\d+\. (\w+)", text.rsplit("\n\n", 1)[1].split("\nQuestion:")[0])
        return " ".join(w for w, _ in Counter(listed).most_common(10))
    words = text.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
    return " ".join(w for w, _ in Counter(w for w in words if w != "...").most_common(3))


def test_items_fill_the_length_in_the_models_tokens(items, smol):
    assert len(items) == len(TASKS) * len(LENGTHS) * 2
    for it in items:
        assert it.input_ids == smol(it.prompt, add_special_tokens=False)["input_ids"]
        total = it.tokens + it.tokens_to_generate
        # the haystack grows by whole units (an essay sentence, a filler line, a word): within 10 % of the length
        assert 0.9 * it.length <= total <= it.length, (it.task, it.length, total)
    for task in TASKS:  # a longer context holds more haystack
        units = {L: [it.units for it in items if it.task == task and it.length == L] for L in LENGTHS}
        assert min(units[2048]) > max(units[1024]), task


def test_needles_are_planted_once_and_answers_are_recoverable(items):
    for it in items:
        text = task_text(it.prompt)
        if it.task.startswith("niah"):
            spec = TASKS[it.task]
            assert len(it.needles) == spec.keys * spec.values
            for needle in it.needles:
                assert text.count(needle) == 1, (it.task, needle)
            for answer in it.answers:  # each expected value stands in the text once: in its needle
                assert text.count(answer) == 1, (it.task, answer)
            assert len(it.answers) == spec.queries * spec.values
        prediction = oracle(it)
        assert sorted(prediction.split()) == sorted(it.answers), (it.task, prediction, it.answers)


def test_oracle_scores_one_and_a_silent_model_zero_through_the_scoring(items):
    planted = score_items(items, oracle, progress=False)
    assert planted["scores"].keys() == TASKS.keys()
    assert all(s == 1.0 for per in planted["scores"].values() for s in per.values())
    assert planted["average"] == {"1024": 1.0, "2048": 1.0}
    silent = score_items(items, lambda item: "I do not know.", progress=False)
    assert all(s == 0.0 for per in silent["scores"].values() for s in per.values())
    # half the values of a 4-value item: half the credit (RULER's string_match_all)
    multi = next(it for it in items if it.task == "niah_multivalue")
    half = score_items([multi], lambda item: " ".join(item.answers[:2]), progress=False)
    assert half["scores"]["niah_multivalue"][str(multi.length)] == 0.5


def test_string_match_all_is_rulers():
    assert string_match_all("  The numbers are 123 and ABC\x07. ", ["abc", "123"]) == 1.0
    assert string_match_all("123", ["123", "456"]) == 0.5
    assert string_match_all("", ["1"]) == 0.0


def test_items_are_a_function_of_the_seed(hay, smol, items):
    render = PromptRenderer(smol, chat=True)
    again = build_item("niah_multikey_2", 1024, 1, hay, render, seed=0)
    first = next(it for it in items if (it.task, it.length, it.index) == ("niah_multikey_2", 1024, 1))
    assert again.prompt == first.prompt and again.answers == first.answers
    other = build_item("niah_multikey_2", 1024, 1, hay, render, seed=1)
    assert other.prompt != first.prompt and other.answers != first.answers
    assert len({it.prompt for it in items}) == len(items)  # every item its own


def test_frequent_words_have_a_strict_top_three():
    c = fwe_counts(400, 20)
    assert c[1] > c[2] > c[3] > max(c[4:]) and c == sorted(c, reverse=True)


def test_task_names_and_groups():
    assert resolve_tasks(["niah"]) == [t for t in TASKS if t.startswith("niah")]
    assert resolve_tasks(["vt,cwe", "vt"]) == ["vt", "cwe"]
    assert len(resolve_tasks(["all"])) == 11


def test_cli_scores_tiny_models_side_by_side_and_writes_table_and_plot(tiny, tmp_path, capsys):
    """A tiny random Llama (the Llama-3.2 tokenizer: no chat template, plain prompts) scored twice under two labels,
    from a plain-text haystack."""
    model = tiny
    txt = tmp_path / "hay.txt"
    txt.write_text(" ".join(f"Sentence number {i} tells of the weather on day {i}, which was fine and calm."
                            for i in range(400)) + " " + " ".join(f"word{chr(97 + i % 26)}{chr(97 + i // 26 % 26)} "
                                                                  f"plainly{chr(97 + i % 26) * 4} is here."
                                                                  for i in range(300)))
    out = tmp_path / "res" / "ruler.json"
    rc = main(["ruler", "--model", str(model), str(model), "--labels", "random", "again", "--tasks", "vt", "fwe",
               "--lengths", "640", "--items", "1", "--haystack", str(txt), "--device", "cpu", "--out", str(out)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"]["markdown"] == str(out.with_suffix(".md"))
    result = json.loads(out.read_text())
    assert [m["label"] for m in result["models"]] == ["random", "again"]
    for m in result["models"]:
        assert not m["chat_template"] and len(m["samples"]) == 2
        assert all(0.0 <= m["scores"][t]["640"] <= 1.0 for t in ("vt", "fwe"))
        for s in m["samples"]:
            assert s["tokens"] + TASKS[s["task"]].tokens_to_generate <= 640
    # greedy decoding: the same model gives the same answers
    assert [s["prediction"] for s in result["models"][0]["samples"]] == \
           [s["prediction"] for s in result["models"][1]["samples"]]
    table = out.with_suffix(".md").read_text()
    assert "| vt |" in table and "random @ 640" in table and "again @ 640" in table
    assert_chart(out.with_suffix(".png"))


def test_cli_refuses_bad_input_in_one_line(tiny, tmp_path, capsys):
    model = tiny
    capsys.readouterr()
    cases = [(["--tasks", "niah_single_9"], "--tasks: unknown task 'niah_single_9'"),
             (["--lengths", "200", "--tasks", "niah_single_1"], "--lengths: 200 tokens is too short for niah_single_1"),
             (["--labels", "a", "b"], "--labels: 2 given for 1 models"),
             (["--haystack", str(tmp_path / "none.txt")], "error: --haystack: ")]
    for extra, message in cases:
        rc = main(["ruler", "--model", str(model), "--device", "cpu", "--out", str(tmp_path / "r.json"), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()
