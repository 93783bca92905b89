"""`upcycle run` on 2 gloo ranks against 1 rank, from a teacher as users hold them: a transformers Llama directory
of two safetensors shards with an untied head and llama3 RoPE scaling. Every stage, at the same global batch
(micro-batch 1: one rank accumulates two, two ranks take one each), gives the same losses, the same SMART choice
and the same final weights to float rounding."""
import json
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO, demo_file, save_sharded_llama3_teacher, subprocess_env
from hybridlm.model import HybridForCausalLM

def route_cmd(tmp, out, ranks):
    small = ["optim.micro_batch_size=1", "optim.global_batch_size=2", "optim.max_steps=2", "optim.warmup_steps=1",
             "optim.precision=fp32", "run.progress=false", "run.eval_interval=0", "run.save_interval=0",
             f"data.val_max_batches={2 // ranks}"]  # counts global batches: the same 2 examples either way
    overrides = [f"output_dir={out}", f"teacher={tmp / 'teacher'}", "init.kv_lora_rank=32", "init.qk_rope_head_dim=8",
                 "init.calib_tokens=512", "init.calib_seq_len=64", f"ild.data.path={tmp / 'data'}",
                 "ild.data.sources=[asset:alpaca_en_demo]", "ild.data.seq_len=32", "smart.n_mla=2",
                 "smart.batches=2", "smart.batch_size=2", "kd.data.path=asset:alpaca_en_demo",
                 "kd.data.max_length=64", "dpo.data.path=asset:dpo_en_demo", "dpo.data.max_length=64",
                 "dpo.data.max_prompt_length=32", "report.seq_len=32", "report.max_tokens=256",
                 "report.generation_prompts=0"]
    overrides += [f"{stage}.{o}" for stage in ("ild", "kd", "dpo") for o in small]
    args = ["-m", "upcycle.cli", "run", "--config", "configs/upcycle/smollm2_route_cpu.yaml", *overrides]
    if ranks == 1:
        return [sys.executable, *args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--nnodes", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(port), *args]


def losses(stage_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, (stage_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


@pytest.mark.slow
def test_the_route_on_two_ranks_equals_one_rank(tmp_path):
    for name in ("dpo_en_demo.json", "alpaca_en_demo.json"):
        demo_file(name)
    save_sharded_llama3_teacher(tmp_path / "teacher", num_layers=4, num_heads=4, head_dim=16)
    runs = {}
    for ranks in (1, 2):  # the 1-rank run prepares the ILD data the 2-rank run reuses
        out = tmp_path / f"route{ranks}"
        res = subprocess.run(route_cmd(tmp_path, out, ranks), cwd=REPO, env=subprocess_env(OMP_NUM_THREADS="1"),
                             capture_output=True, text=True, timeout=1500)
        assert res.returncode == 0, res.stderr[-4000:]
        runs[ranks] = out
    one, two = runs[1], runs[2]
    assert json.loads((one / "route.json").read_text())["smart"] == json.loads((two / "route.json").read_text())["smart"]
    init = json.loads((one / "init" / "init_report.json").read_text())
    assert init["rope"]["rope_type"] == "llama3" and init["rope"]["mismatched"] == 0
    for stage in ("ild_mla", "ild_mamba2", "kd", "dpo"):
        a, b = losses(one / stage), losses(two / stage)
        assert [s for s, _ in a] == [s for s, _ in b] == [1, 2], stage
        assert [l for _, l in b] == pytest.approx([l for _, l in a], rel=1e-5), stage
    m1 = HybridForCausalLM.from_pretrained(one / "dpo" / "final").state_dict()
    m2 = HybridForCausalLM.from_pretrained(two / "dpo" / "final").state_dict()
    assert m1.keys() == m2.keys()
    for k in m1:
        assert torch.allclose(m1[k], m2[k], rtol=1e-4, atol=1e-6), k
    assert not torch.equal(m1["lm_head.weight"], m1["model.embed_tokens.weight"])  # the untied head stays untied
