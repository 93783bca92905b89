"""The ``upcycle`` command as a user runs it (tiny random Llama directories; the real SmolLM2 route is
exercised in test_upcycle_init_mamba.py and on a GPU), and the flags it still accepts under their old names."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from conftest import REPO, save_tiny_llama
from hybridlm.model import HybridForCausalLM


def upcycle(*args):
    return subprocess.run([sys.executable, "-m", "upcycle.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("teacher") / "llama")


def test_kv_report_reproduces_a_published_ratio():
    proc = upcycle("kv-report", "--teacher", "configs/llama/llama-3.1-8b.json", "--mla-layers",
                   ",".join(str(i) for i in range(0, 32, 4)), "--kv-lora-rank", 160, "--qk-rope-head-dim", 64)
    assert proc.returncode == 0, proc.stderr
    assert "compression 36.6x" in proc.stdout
    # the other 24 layers are the default linear student's, with the fixed state of `upcycle init`'s Mamba2
    # (32 heads x 128 x 128 SSD state + the conv's 4 x (1024 + 1024 + 4096) channels)
    assert "KV cache: 8 MLA + 24 Mamba2 of 32 layers" in proc.stdout
    assert f"Mamba2 24 x {32 * 128 * 128 + 4 * 6144:,}" in proc.stdout


def test_kv_report_old_flag_names_still_work():
    """``--kv-rank`` / ``--rope-dim`` (the README's names before ``--kv-lora-rank`` / ``--qk-rope-head-dim``): the
    same report, and one note each on stderr naming the new flag."""
    common = ["kv-report", "--teacher", "configs/llama/llama-3.2-1b.json", "--mla-layers", "0,2,4,6,8,10,12,14"]
    new = upcycle(*common, "--kv-lora-rank", 128, "--qk-rope-head-dim", 32)
    old = upcycle(*common, "--kv-rank", 128, "--rope-dim", 32)
    assert new.returncode == old.returncode == 0, old.stderr
    assert old.stdout == new.stdout and "compression 12.8x" in old.stdout
    notes = [line for line in old.stderr.splitlines() if "note:" in line]
    assert notes == ["upcycle kv-report: note: --kv-rank is now --kv-lora-rank; the old name goes in the next release",
                     "upcycle kv-report: note: --rope-dim is now --qk-rope-head-dim; the old name goes in the next "
                     "release"]
    assert "note:" not in new.stderr


def test_kv_report_names_the_linear_mixer():
    proc = upcycle("kv-report", "--teacher", "configs/llama/llama-3.2-1b.json", "--mla-layers", "0,8",
                   "--kv-lora-rank", 128, "--qk-rope-head-dim", 32, "--linear-mixer", "gdn")
    assert proc.returncode == 0, proc.stderr
    # `upcycle init`'s GDN: 32 heads of 64 for q, k and v: a 32 x 64 x 64 state, convs of 4 x 3 x 2048 channels
    assert "KV cache: 2 MLA + 14 GDN of 16 layers (values per token and layer: MLA 160, GDN 0;" in proc.stdout
    assert f"GDN 14 x {32 * 64 * 64 + 4 * 3 * 2048:,}" in proc.stdout


@pytest.mark.parametrize("command", ["compose", "smart"])
def test_the_old_linear_student_flag_still_works(command, capsys):
    from upcycle.cli import build_parser
    extra = {"compose": ["--mla-layers", "0", "--out", "x"],
             "smart": ["--teacher", "t", "--data-path", "d", "--n-mla", "1", "--out", "x"]}[command]
    args = build_parser().parse_args([command, "--mla-student", "a", "--mamba-student", "b", *extra])
    assert args.linear_student == "b"
    assert capsys.readouterr().err == (f"upcycle {command}: note: --mamba-student is now --linear-student; the old "
                                       f"name goes in the next release\n")
    args = build_parser().parse_args([command, "--mla-student", "a", "--linear-student", "b", *extra])
    assert args.linear_student == "b" and capsys.readouterr().err == ""


def test_init_writes_loadable_students_and_reports_kv(tmp_path, tiny_llama):
    out = tmp_path / "init"
    proc = upcycle("init", "--teacher", tiny_llama, "--out", out, "--kv-lora-rank", 32, "--qk-rope-head-dim", 8)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "init_report.json").read_text())
    assert report["students"]["mla"]["kv_values_per_token"] == 4 * (32 + 8)
    assert report["students"]["mla"]["teacher_kv_values_per_token"] == 4 * 2 * 2 * 16
    assert report["students"]["mamba2"]["kv_values_per_token"] == 0
    # 4 layers of 4 heads x 16 x 16 SSD state + the conv's 4 inputs of x, B (2 kv heads x 16 each) and C (4 x 16)
    assert report["students"]["mamba2"]["state_values_per_sequence"] == 4 * (4 * 16 * 16 + 4 * (32 + 32 + 64))
    assert report["students"]["mla"]["state_values_per_sequence"] == 0
    teacher = LlamaForCausalLM.from_pretrained(tiny_llama)
    for kind in ("mla", "mamba2"):
        student = HybridForCausalLM.from_pretrained(out / f"{kind}_student")
        assert set(student.config.layer_plan) == {kind, "mlp"}
        assert torch.equal(student.model.layers[1].mixer.up_proj.weight, teacher.model.layers[0].mlp.up_proj.weight)
        assert (out / f"{kind}_student" / "tokenizer.json").is_file()
    assert "compression" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--kv-lora-rank", 4096, "--qk-rope-head-dim", 8], "error: kv_lora_rank: 4096 exceeds what the"),
    (["--qk-rope-head-dim", 7], "error: qk_rope_head_dim: 7 must be even"),
])
def test_init_bad_ranks_are_one_line_and_write_nothing(tmp_path, tiny_llama, args, message):
    out = tmp_path / "init"
    proc = upcycle("init", "--teacher", tiny_llama, "--out", out, *args)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-400:]
    assert not (out / "mla_student").exists() and not (out / "mamba2_student").exists()


def test_init_refuses_a_non_llama_teacher(tmp_path):
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(gpt2)
    proc = upcycle("init", "--teacher", gpt2, "--out", tmp_path / "x")
    assert proc.returncode == 2
    assert "expected a Llama model" in proc.stderr.strip().splitlines()[-1]


def test_kv_report_layer_out_of_range():
    proc = upcycle("kv-report", "--teacher", "configs/llama/llama-3.2-1b.json", "--mla-layers", "0,16",
                   "--kv-lora-rank", 128, "--qk-rope-head-dim", 32)
    assert proc.returncode == 2 and "index 16 out of range for a 16-layer teacher" in proc.stderr


def test_init_names_a_damaged_teacher(tmp_path, tiny_llama):
    """A teacher whose weights were cut short (an interrupted copy): one line naming it, nothing written."""
    import shutil
    damaged = tmp_path / "teacher"
    shutil.copytree(tiny_llama, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    proc = upcycle("init", "--teacher", damaged, "--out", tmp_path / "init")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-600:]
    assert last.startswith(f"error: {damaged}") and "cannot be loaded" in last
    assert not (tmp_path / "init").exists()


@pytest.mark.parametrize("command", [["run", "--config", "route.yaml", "smart.n_mla=4"], ["kd", "--config", "kd.yaml"]])
def test_the_deepspeed_launchers_local_rank_is_accepted_before_the_subcommand(command):
    """`deepspeed --num_gpus N --module upcycle.cli run ...` passes --local_rank=K first."""
    from upcycle.cli import build_parser
    args = build_parser().parse_args(["--local_rank=1", *command])
    assert args.command == command[0] and args.config == command[2]


def _tables(text):
    """The first cell of every row of each table in ``text`` (tables are separated by blank lines)."""
    return [[line.split("|")[1].strip() for line in block.splitlines() if line.startswith("| ")]
            for block in text.split("\n\n")]


def test_plan_prints_every_stage_from_a_config_json_alone():
    proc = upcycle("plan", "--config", "configs/upcycle/llama3.2-1b_8mla_route.yaml", "--gpus", 8,
                   "--teacher", "configs/llama/llama-3.2-1b.json")
    assert proc.returncode == 0, proc.stderr
    assert _tables(proc.stdout) == [["stage", "init", "ild_mla", "ild_mamba2", "smart", "kd", "dpo"],
                                    ["mixer", "mla", "mamba2"]]
    gdn = upcycle("plan", "--config", "configs/upcycle/llama3.2-1b_8mla_route.yaml", "--gpus", 8,
                  "--teacher", "configs/llama/llama-3.2-1b.json", "init.linear_mixer=gdn")
    assert gdn.returncode == 0, gdn.stderr
    assert _tables(gdn.stdout) == [["stage", "init", "ild_mla", "ild_gdn", "smart", "kd", "dpo"], ["mixer", "mla", "gdn"]]
    row = next(line for line in gdn.stdout.splitlines() if line.startswith("| gdn "))
    # 8 layers; 32 value heads of 64: 32 x (6 C K + 4 C V + C^2 / 3 + 6 K V) with C = K = V = 64, no per-token cache
    assert [c.strip() for c in row.strip("|").split("|")][:5] == ["gdn", "8", "2.14M", "0", f"{32 * 64 * 64 + 4 * 3 * 2048:,}"]
    missing = upcycle("plan", "--config", "configs/upcycle/llama3.2-1b_8mla_route.yaml")  # models/ not there
    assert missing.returncode == 2 and "give --teacher a config.json" in missing.stderr.strip().splitlines()[-1]
