"""The ``upcycle`` command as a user runs it (tiny random Llama directories; the real SmolLM2 route is
exercised in test_upcycle_init_mamba.py and on a GPU)."""
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


def test_init_writes_loadable_students_and_reports_kv(tmp_path, tiny_llama):
    out = tmp_path / "init"
    proc = upcycle("init", "--teacher", tiny_llama, "--out", out, "--kv-lora-rank", 32, "--qk-rope-head-dim", 8)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "init_report.json").read_text())
    assert report["students"]["mla"]["kv_values_per_token"] == 4 * (32 + 8)
    assert report["students"]["mla"]["teacher_kv_values_per_token"] == 4 * 2 * 2 * 16
    assert report["students"]["mamba2"]["kv_values_per_token"] == 0
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


def test_plan_prints_every_stage_from_a_config_json_alone():
    proc = upcycle("plan", "--config", "configs/upcycle/llama3.2-1b_8mla_route.yaml", "--gpus", 8,
                   "--teacher", "configs/llama/llama-3.2-1b.json")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows == ["stage", "init", "ild_mla", "ild_mamba2", "smart", "kd", "dpo"]
    missing = upcycle("plan", "--config", "configs/upcycle/llama3.2-1b_8mla_route.yaml")  # models/ not there
    assert missing.returncode == 2 and "give --teacher a config.json" in missing.stderr.strip().splitlines()[-1]
