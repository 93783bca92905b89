"""hybrid-eval: perplexity (checked against a direct forward), bad input, lm-evaluation-harness on the local
Jane Austen cloze task, and the task builder's determinism. Real text: Jane Austen (asset:janeausten)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, save_tiny_llama, tiny_config

SEQ_LEN, MAX_TOKENS = 64, 256


@pytest.fixture(scope="module")
def tok():
    from hybridlm.data import load_tokenizer
    return load_tokenizer("asset:llama3.2")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok):
    """A tiny random hybrid (every sublayer kind) and a tiny random Llama, both with the Llama-3.2 tokenizer."""
    from hybridlm.model import HybridForCausalLM
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    HybridForCausalLM(tiny_config(vocab_size=len(tok))).save_pretrained(root / "hybrid")
    tok.save_pretrained(root / "hybrid")
    save_tiny_llama(root / "llama", num_layers=2)
    return {"hybrid": root / "hybrid", "llama": root / "llama"}


@pytest.fixture(scope="module")
def austen_files(tmp_path_factory):
    """Two real passages (Persuasion, Emma chapter openings) as .txt files."""
    from hybridlm.data.assets import corpus_path
    root = tmp_path_factory.mktemp("austen")
    files = []
    for book in ("persuasion", "emma"):
        text = (corpus_path() / f"{book}.txt").read_text(encoding="utf-8")
        start = text.lower().index("chapter")
        files.append(root / f"{book}.txt")
        files[-1].write_text(text[start:start + 1200], encoding="utf-8")
    return files


@pytest.fixture(scope="module")
def austen_tasks(tmp_path_factory):
    from hybridlm.eval.build_tasks import build_austen_cloze
    root = tmp_path_factory.mktemp("tasks")
    build_austen_cloze(root)
    return root


def _run_main(capsys, argv):
    from hybridlm.eval.cli import main
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@torch.no_grad()
def _direct_ppl(model, tok, texts):
    """exp(mean NLL) from scratch: each text's ids + EOS, consecutive SEQ_LEN windows, one forward per window."""
    ids = []
    for text in texts:
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = min(len(ids) - 1, MAX_TOKENS) // SEQ_LEN
    nll = []
    for i in range(n):
        w = torch.tensor(ids[i * SEQ_LEN:(i + 1) * SEQ_LEN + 1])[None]
        logits = model(input_ids=w[:, :-1]).logits.float()
        nll.append(F.cross_entropy(logits[0], w[0, 1:], reduction="none"))
    nll = torch.cat(nll)
    return math.exp(nll.mean().item()), nll.numel()


@pytest.mark.parametrize("kind", ["hybrid", "llama"])
def test_ppl_matches_direct_forward(kind, models, tok, austen_files, tmp_path, capsys):
    out_file = tmp_path / "ppl.json"
    rc, out, err = _run_main(capsys, ["ppl", "--model", models[kind], "--text", *austen_files,
                                      "--seq-len", SEQ_LEN, "--max-tokens", MAX_TOKENS, "--batch-size", 3,
                                      "--device", "cpu", "--out", out_file])
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert json.loads(out_file.read_text()) == res
    assert res["model_type"] == kind and res["seq_len"] == SEQ_LEN and res["windows"] == MAX_TOKENS // SEQ_LEN

    if kind == "hybrid":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(models[kind])
    else:
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM.from_pretrained(models[kind])
    texts = [f.read_text(encoding="utf-8") for f in austen_files]
    want, count = _direct_ppl(model.eval(), tok, texts)
    assert res["tokens"] == count == MAX_TOKENS
    assert res["ppl"] == pytest.approx(want, rel=1e-4)
    assert res["nll"] == pytest.approx(math.log(want), rel=1e-5)


def test_ppl_dataset_folder_equals_text_file(models, austen_files, tmp_path, capsys):
    """--dataset DIR:split reads the records like --text reads the same JSONL file."""
    data = tmp_path / "ds"
    data.mkdir()
    rows = "".join(json.dumps({"text": f.read_text(encoding="utf-8")}) + "\n" for f in austen_files)
    (data / "test.jsonl").write_text(rows, encoding="utf-8")
    common = ["--model", models["hybrid"], "--seq-len", SEQ_LEN, "--max-tokens", MAX_TOKENS, "--device", "cpu"]
    rc1, out1, err1 = _run_main(capsys, ["ppl", "--dataset", f"{data}:test", *common])
    rc2, out2, err2 = _run_main(capsys, ["ppl", "--text", data / "test.jsonl", *common])
    assert rc1 == 0 and rc2 == 0, err1 + err2
    a, b = json.loads(out1), json.loads(out2)
    assert a["tokens"] == b["tokens"] == MAX_TOKENS and a["ppl"] == pytest.approx(b["ppl"], rel=1e-6)


def test_bad_input_is_one_line(models, austen_files, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n", encoding="utf-8")
    no_config = tmp_path / "not_a_model"
    no_config.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x", encoding="utf-8")
    import shutil
    truncated = tmp_path / "truncated_hybrid"  # a copy cut short: safetensors' header no longer parses
    shutil.copytree(models["hybrid"], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    cases = [
        (["--model", truncated, "--text", austen_files[0]], "cannot be loaded as a hybrid"),
        # checked before the evaluation runs, so no result is computed and then lost
        (["--model", models["hybrid"], "--text", austen_files[0], "--out", a_file / "res.json"], "--out: cannot write"),
        (["--model", tmp_path / "missing", "--text", austen_files[0]], "no such file or directory"),
        (["--model", no_config, "--text", austen_files[0]], "config.json"),
        (["--model", models["hybrid"], "--text", tmp_path / "missing.txt"], "no such file or directory"),
        (["--model", models["hybrid"], "--text", empty], "no text to evaluate"),
    ]
    # the first through a real process (exit code and stderr as a user sees them), the rest in this one
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "hybridlm.eval", "ppl", *map(str, cases[0][0])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    results = [(proc.returncode, proc.stdout, proc.stderr)]
    results += [_run_main(capsys, ["ppl", *args]) for args, _ in cases[1:]]
    for (rc, out, err), (_, needle) in zip(results, cases):
        assert rc == 2 and out == "", err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_lm_eval_without_package_is_one_line(models, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    rc, out, err = _run_main(capsys, ["lm-eval", "--model", models["hybrid"], "--tasks", "austen_cloze",
                                      "--device", "cpu"])
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and "pip install -e '.[eval]'" in err


def test_lm_eval_local_task_on_tiny_hybrid(models, austen_tasks, tmp_path, capsys):
    if not os.environ.get("CI"):  # lm_eval is in the test extra; outside CI an older venv may lack it
        pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install -e '.[test]')")
    out_file = tmp_path / "lm.json"
    rc, out, err = _run_main(capsys, ["lm-eval", "--model", models["hybrid"], "--tasks", "austen_cloze",
                                      "--include-path", austen_tasks, "--limit", 6, "--batch-size", 4,
                                      "--device", "cpu", "--out", out_file])
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert json.loads(out_file.read_text()) == res
    metrics = res["tasks"]["austen_cloze"]
    assert res["n_samples"]["austen_cloze"] == {"original": 500, "effective": 6}
    # the same 6 items scored without the harness (hybridlm.eval.multiple_choice, which the route's report uses
    # where lm_eval is not installed): the same acc and acc_norm
    from transformers import AutoTokenizer
    from hybridlm.eval.multiple_choice import multiple_choice_accuracy
    from hybridlm.model import HybridForCausalLM
    model = HybridForCausalLM.from_pretrained(models["hybrid"]).eval()
    tok = AutoTokenizer.from_pretrained(models["hybrid"])
    items = [json.loads(l) for l in (austen_tasks / "austen_cloze" / "austen_cloze.jsonl").read_text().splitlines()][:6]
    ours = multiple_choice_accuracy(model, tok, items, batch_size=5)  # batches that split items: padding is inert
    for name in ("acc", "acc_norm"):
        assert metrics[name] == pytest.approx(ours[name]), (name, metrics, ours)
    assert res["model_type"] == "hybrid"


def test_build_tasks_deterministic_and_true_to_the_text(tmp_path, capsys):
    from hybridlm.data.assets import corpus_path
    from hybridlm.eval.build_tasks import main as build_main
    dirs = []
    for name in ("a", "b"):
        assert build_main(["--out", str(tmp_path / name)]) == 0
        dirs.append(tmp_path / name / "austen_cloze")
    capsys.readouterr()
    data = [(d / "austen_cloze.jsonl").read_bytes() for d in dirs]
    assert data[0] == data[1]
    yamls = [(d / "austen_cloze.yaml").read_text().replace(str(d), "DIR") for d in dirs]
    assert yamls[0] == yamls[1] and "dataset_path: json" in yamls[0]

    items = [json.loads(line) for line in data[0].decode().splitlines()]
    assert len(items) == 500 and len({it["id"] for it in items}) == 500
    corpus = {p.stem: " ".join(p.read_text(encoding="utf-8").split()) for p in corpus_path().glob("*.txt")}
    for it in items[::25]:
        assert len(set(it["choices"])) == 4 and 0 <= it["label"] < 4
        # context + gold word + "." is a real run of the book's text
        assert f'{it["context"]} {it["choices"][it["label"]]}.' in corpus[it["book"]]


def test_ppl_packed_validation_split_equals_its_text(models, austen_files, tmp_path, capsys):
    """--packed DIR scores hybrid-prepare's validation split: the same numbers as --text on that document."""
    from hybridlm.data.packed import PackedTokens
    from hybridlm.data.prepare import prepare
    prepare([str(f) for f in austen_files], "asset:llama3.2", tmp_path / "packed", val_fraction=0.5,
            progress=False)
    assert len(PackedTokens(tmp_path / "packed", "val")) > 2 * SEQ_LEN
    common = ["--model", models["hybrid"], "--seq-len", SEQ_LEN, "--max-tokens", 2 * SEQ_LEN, "--device", "cpu"]
    rc, out, err = _run_main(capsys, ["ppl", "--packed", tmp_path / "packed", *common])
    assert rc == 0, err
    packed = json.loads(out)
    assert packed["tokens"] == 2 * SEQ_LEN
    per_file = []
    for f in austen_files:
        rc, out, err = _run_main(capsys, ["ppl", "--text", f, *common])
        assert rc == 0, err
        per_file.append(json.loads(out)["ppl"])
    assert any(p == pytest.approx(packed["ppl"], rel=1e-6) for p in per_file), (packed["ppl"], per_file)


def test_multiple_choice_log_likelihoods_match_one_forward_per_pair(models):
    """Batched, right-padded scoring equals one unpadded forward per pair; a context's trailing space moves into
    the continuation, as the harness encodes a pair."""
    from transformers import AutoTokenizer
    from hybridlm.eval.multiple_choice import continuation_logprobs, encode_pair, multiple_choice_accuracy
    from hybridlm.model import HybridForCausalLM
    model = HybridForCausalLM.from_pretrained(models["hybrid"]).eval()
    tok = AutoTokenizer.from_pretrained(models["hybrid"])
    ctx, cont = encode_pair(tok, "It is a truth universally ", "acknowledged")
    assert tok.decode(cont) == " acknowledged" and tok.decode(ctx) == "It is a truth universally"
    pairs = [encode_pair(tok, c, " " + w) for c, w in (("She was the youngest of the two daughters", "of"),
                                                        ("Emma Woodhouse, handsome, clever, and", "rich"),
                                                        ("A short one", "extraordinarily"))]
    batched = continuation_logprobs(model, pairs, batch_size=3)
    for (c, t), got in zip(pairs, batched):
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([c + t])).logits[0].float().log_softmax(-1)
        want = sum(logp[len(c) - 1 + i, tok_id].item() for i, tok_id in enumerate(t))
        assert got == pytest.approx(want, abs=1e-4)
    context, choices = "She was the youngest of the two daughters", ["of", "rich", "extraordinarily"]
    lls = continuation_logprobs(model, [encode_pair(tok, context, " " + w) for w in choices])
    best = max(range(3), key=lambda i: lls[i])
    best_norm = max(range(3), key=lambda i: lls[i] / len(choices[i]))
    for label in range(3):
        res = multiple_choice_accuracy(model, tok, [{"context": context, "choices": choices, "label": label}])
        assert res == {"acc": float(label == best), "acc_norm": float(label == best_norm), "items": 1}
