"""The training-throughput benchmark: its FLOP formula by hand, and a real CPU run of the command.

The run goes through pretrain.py's own setup / engine / loop on the real embedded data (Jane Austen,
Llama-3.2 tokenizer) with a tiny model, plus the transformers Llama peer; fla peers need CUDA and are
recorded as skipped.
"""
import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import REPO, subprocess_env, assert_chart
from benchmarks.harness import flops as F


class MLPOnly(nn.Module):
    """Embedding -> two linears -> tied LM head: no sequence mixer, so FLOPs are exactly 6 N per token."""

    def __init__(self, vocab=100, d=16, f=24, tied=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up, self.down = nn.Linear(d, f, bias=True), nn.Linear(f, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("tied", [True, False])
def test_mlp_only_model_costs_six_n_per_token(tied):
    model = MLPOnly(tied=tied)
    n = 16 * 24 + 24 * 16 + 100 * 16  # the two weights (bias is 1-D: not a matmul) + the LM head once
    assert F.matmul_params(model) == n
    tokens = 4 * 2048
    f = F.train_flops_per_token(F.matmul_params(model), [])
    assert f["total"] * tokens == 6 * n * tokens and f["attention"] == f["recurrence"] == 0


def test_hybrid_gdn_layer_by_hand():
    from hybridlm.model import HybridConfig
    from hybridlm.model.summary import build_on_meta
    cfg = HybridConfig(vocab_size=100, hidden_size=16, intermediate_size=24, hybrid_override_pattern="G-",
                       runtime={"backend": "torch"},
                       gdn=dict(num_heads=2, head_dim=8, num_v_heads=2, head_v_dim=8, conv_size=4))
    d = 16
    gdn = d * (16 + 16 + 16 + 2 + 2 + 16) + 16 * d + 3 * 16 * 4  # q k v b a g, o_proj, three conv kernels
    n = gdn + 3 * d * 24 + 100 * d                                 # + SwiGLU + tied LM head
    assert F.matmul_params(build_on_meta(cfg)) == n == 4288
    mixers = F.hybrid_mixers(cfg, 512)
    C = 64
    rec = 2 * (18 * C * 8 + 12 * C * 8 + C * C + 18 * 8 * 8)       # 2 value heads: 41216
    assert [(m.kind, m.attention) for m in mixers] == [("gdn", False)] and 3 * mixers[0].forward == pytest.approx(rec)
    f = F.train_flops_per_token(n, mixers)
    assert f == pytest.approx({"dense": 6 * 4288, "attention": 0.0, "recurrence": rec, "total": 6 * 4288 + rec})


def test_attention_and_chunk_terms_by_hand():
    from hybridlm.model import HybridConfig
    cfg = HybridConfig(vocab_size=100, hidden_size=32, intermediate_size=24, hybrid_override_pattern="*-S-",
                       runtime={"backend": "torch"}, mla=dict(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                                                 qk_rope_head_dim=4, v_head_dim=8),
                       mamba2=dict(d_state=4, head_dim=16, n_groups=1, expand=2))
    from hybridlm.model.layers.mixing_flops import delta_rule_flops, simple_gla_flops
    T = 10  # causal: half of the 6 H T (d_qk + d_v) of unmasked attention
    mla, ssd = F.hybrid_mixers(cfg, T)
    assert (mla.kind, mla.attention, ssd.kind, ssd.attention) == ("mla", True, "mamba2", False)
    assert 3 * mla.forward == 6 * 2 * T * (8 + 8) / 2 == 960
    assert 3 * ssd.forward == 4 * (6 * 64 * (4 + 16) + 12 * 4 * 16)  # 4 heads, d_state 4, head_dim 16
    assert 3 * simple_gla_flops(4, 4, 16, chunk=2) == 4 * (6 * 2 * (4 + 16) + 12 * 4 * 16)
    assert 3 * delta_rule_flops(1, 1, 1, chunk=1) == pytest.approx(18 + 12 + 1 + 18)
    assert F.train_flops_per_token(0, [mla, ssd]) == {"dense": 0.0, "attention": 960.0, "recurrence": 3 * ssd.forward,
                                                      "total": 960.0 + 3 * ssd.forward}
    from transformers import LlamaConfig
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3)
    assert F.llama_mixers(llama, T) == [F.MixerFlops(F.LLAMA_ATTENTION, True, 4 * T * (16 + 16))] * 3
    assert F.mfu(1e9, 2e5, 989.5, 2) == pytest.approx(1e9 * 2e5 / (2 * 989.5e12))


def test_find_max_batch_takes_the_largest_that_fits():
    from types import SimpleNamespace
    from benchmarks.train_speed import OOM, measure

    def fn(mb):
        if mb > 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        t = {"tokens_per_step": mb * 8, "step_ms": 10.0, "tokens_per_s": mb * 800.0, "final_loss": 1.0}
        return {"timing": t, "flops": {"total": 1e6}}

    args = SimpleNamespace(seq=8, peak_tflops=1.0)
    e = measure("x", "ours", fn, [64, 32, 16, 8], catch_oom=True, args=args, world=1)
    assert e["status"] == "ok" and e["micro_batch"] == 16
    assert e["micro_batches_tried"] == {"64": OOM, "32": OOM, "16": "ok"}
    assert e["mfu"] == pytest.approx(1e6 * 16 * 800 / 1e12)
    e = measure("x", "ours", fn, [64], catch_oom=True, args=args, world=1)
    assert e["status"] == OOM
    with pytest.raises(torch.cuda.OutOfMemoryError):
        measure("x", "ours", fn, [64], catch_oom=False, args=args, world=2)




VARIANT = "model.intermediate_size=64:optim.grad_clip=0.5:runtime.loss_chunks=2"


def test_config_variants_parse_and_bad_ones_say_what_is_expected():
    from benchmarks.train_speed import file_stem, split_variant
    assert split_variant("gdn_300m") == ("gdn_300m", {"model": [], "optim": [], "runtime": []})
    assert split_variant("gdn_300m:optim.step_on_device=true:runtime.split_conv_outputs=true:model.mixer=kda") == (
        "gdn_300m", {"model": ["mixer=kda"], "optim": ["step_on_device=true"],
                     "runtime": ["split_conv_outputs=true"]})
    assert file_stem("gdn_300m:optim.step_on_device=true") == "gdn_300m_optim.step_on_device_true"
    assert file_stem("fla_gdn+late") == "fla_gdn_late" and file_stem("configs/models/gdn_300m.yaml") == "gdn_300m"
    for bad in ("gdn_300m:step_on_device=true", "gdn_300m:run.x=1", "gdn_300m:optim.lr"):
        with pytest.raises(SystemExit, match=r"each override after ':' must be model.KEY=VALUE, optim.KEY=VALUE "
                                             r"or runtime.KEY=VALUE"):
            split_variant(bad)


def test_keep_going_reports_a_failed_entry_and_runs_the_next(tmp_path, austen_data):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "benchmarks.train_speed", "--out", str(out), "--data", str(austen_data),
           "--configs", "tiny_hybrid:model.rms_norm_eps=-1", "tiny_hybrid", "--peers", "--micro-batch", "2",
           "--seq", "32", "--steps", "1", "--warmup", "1", "--keep-going", "--norm-kernel", "fla"]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "train_speed: 1 entries failed: tiny_hybrid:model.rms_norm_eps=-1" in proc.stderr
    report = json.loads((out / "train_speed.json").read_text())
    # --norm-kernel: our models' runtime.norm_kernel
    assert report["norm_kernel"] == "fla" and report["runtime_override"] == ["norm_kernel=fla"]
    bad, good = report["entries"]
    assert bad["status"] == "failed" and "rms_norm_eps: must be a positive number" in bad["reason"]
    assert good["status"] == "ok" and good["tokens_per_s"] > 0
    assert_chart(out / "train_speed.png")


# ~45 s on 2 cores: the benchmark harness end to end, with the slow CPU tests (.ci/run runs them next)
@pytest.mark.slow
def test_cpu_run_writes_json_and_chart(tmp_path, austen_data):
    out = tmp_path / "bench"
    env = subprocess_env()
    cmd = [sys.executable, "-m", "benchmarks.train_speed", "--out", str(out), "--data", str(austen_data),
           "--configs", "tiny_hybrid", f"tiny_hybrid:{VARIANT}", "--peers", "llama:tiny_hybrid", "fla_gdn", "llama:tiny_hybrid+late",
           "--micro-batch", "2",
           "--seq", "32", "--steps", "2", "--warmup", "1", "--profile", "2", "--trace",
           "--optim-override", "immediate_grad_update=true"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "train_speed.json").read_text())
    assert report["world_size"] == 1 and report["precision"] == "fp32" and report["seq_len"] == 32
    assert report["mamba2_compile_inputs"] == "off" and report["conv_x_once"] == "off"
    entries = {e["name"]: e for e in report["entries"]}
    assert list(entries) == ["tiny_hybrid", f"tiny_hybrid:{VARIANT}", "llama:tiny_hybrid", "fla_gdn",
                             "llama:tiny_hybrid+late"]
    # a variant of a config with overrides of its own, in the same run
    variant = entries[f"tiny_hybrid:{VARIANT}"]
    assert variant["overrides"] == {"model": ["intermediate_size=64"], "optim": ["grad_clip=0.5"],
                                    "runtime": ["loss_chunks=2"]}
    assert entries["tiny_hybrid"]["overrides"] == {"model": [], "optim": [], "runtime": []}
    assert variant["status"] == "ok" and variant["params"] < entries["tiny_hybrid"]["params"]
    assert entries["fla_gdn"]["status"] == "skipped" and "CUDA" in entries["fla_gdn"]["reason"]

    from hybridlm.data import read_meta
    from hybridlm.model.summary import build_on_meta
    from benchmarks.harness.common import model_section
    from hybridlm.model.configuration import resolve_model_config
    cfg = resolve_model_config(model_section("tiny_hybrid", []), read_meta(austen_data), austen_data)
    expected = F.train_flops_per_token(F.matmul_params(build_on_meta(cfg)), F.hybrid_mixers(cfg, 32))["total"]
    ours, llama, late = entries["tiny_hybrid"], entries["llama:tiny_hybrid"], entries["llama:tiny_hybrid+late"]
    assert ours["flops_per_token"] == expected and ours["flops"]["attention"] > 0 and ours["flops"]["recurrence"] > 0
    # the same peer with its loss read one step late (and one more step run, for the profiler's last window)
    late_read = "after the next step is launched"
    assert late_read not in llama["recipe"] and late_read in late["recipe"]
    assert late["params"] == llama["params"] and late["final_loss"] != llama["final_loss"]
    for e in (ours, llama, late):
        assert e["status"] == "ok" and e["micro_batch"] == 2 and e["tokens_per_step"] == 64
        assert e["tokens_per_s"] > 0 and len(e["step_ms_all"]) == 2 and math.isfinite(e["final_loss"])
        assert math.isfinite(e["mfu"]) and e["mfu"] > 0
        # two more steps ran under the profiler; they are not in the timing
        prof = e["profile"]
        assert prof["profiled_steps"] == 2 and prof["ms_per_step"] > 0
        gemm = [c for c in prof["categories"] if c["category"] == "matmul (GEMM)"]
        assert len(gemm) == 1 and gemm[0]["ms_per_step"] > 0 and 0 < gemm[0]["share"] < 1
        # the GEMMs by shape: the LM head's (a vocabulary-wide operand) among them, each with its rate
        assert any(128256 in sum(g["shapes"], []) for g in prof["gemms"]), prof["gemms"]
        assert all(g["tflops"] > 0 and g["gflop_per_call"] > 0 and g["calls_per_step"] > 0 for g in prof["gemms"])
        assert e["mfu"] == pytest.approx(e["flops_per_token"] * e["tokens_per_s"] / (989.5e12))
    assert llama["params"] == llama["non_embedding_params"] + 128256 * 128  # tied, hidden 128
    assert "DeepSpeed ZeRO-1" in ours["recipe"] and "plain PyTorch" in llama["recipe"]
    assert_chart(out / "train_speed.png")
    assert "ours tiny_hybrid" in proc.stdout and "tok/s" in proc.stdout
    # --trace: each profiled entry's steps as a Chrome trace with Python stacks (a CPU run has no kernels)
    from benchmarks.harness.trace_gaps import load_events
    from benchmarks.train_speed import file_stem
    for name in ("tiny_hybrid", file_stem(f"tiny_hybrid:{VARIANT}"), "llama_tiny_hybrid",
                 "llama_tiny_hybrid_late"):
        events = load_events(out / f"trace_{name}.json.gz")
        frames = [e["name"] for e in events if e.get("cat") == "python_function"]
        assert any("hybridlm/" in f for f in frames), frames[:5]

    from benchmarks.train_speed import merge
    merged = merge([str(out / "train_speed.json"), str(out / "train_speed.json")], tmp_path / "merged")
    assert [e["name"] for e in merged["entries"]] == list(entries)
    assert_chart(tmp_path / "merged" / "train_speed.png")
    # the same entry at another micro-batch is another measurement: kept next to the first
    other = json.loads((out / "train_speed.json").read_text())
    for e in other["entries"]:
        e["micro_batch"] = e.get("micro_batch", 0) + 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    both = merge([str(out / "train_speed.json"), str(tmp_path / "other.json")], tmp_path / "both")
    assert len(both["entries"]) == 2 * len(entries) and "micro_batch" not in both


def test_profile_categories():
    from benchmarks.harness.profile_step import categorize
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul (GEMM)"
    assert categorize("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "linear recurrence (fla chunk / recurrent)"
    assert categorize("ncclDevKernel_AllReduce_Sum_f32") == "nccl / communication"
    assert categorize("multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert categorize("aten::addmm") == "matmul (GEMM)"
    assert categorize("something_unheard_of") == "other"


def test_gemm_flops_from_the_profilers_shapes():
    from benchmarks.harness.profile_step import gemm_flops
    assert gemm_flops("aten::mm", [[16, 8], [8, 4]]) == 2 * 16 * 8 * 4
    assert gemm_flops("aten::addmm", [[4], [16, 8], [8, 4]]) == 2 * 16 * 8 * 4  # the added term is not a factor
    assert gemm_flops("aten::bmm", [[3, 16, 8], [3, 8, 4]]) == 3 * 2 * 16 * 8 * 4
    assert gemm_flops("aten::mm", [[16, 8], [7, 4]]) is None  # not a product of matrices
    assert gemm_flops("aten::linear", [[16, 8], [4, 8]]) is None  # calls mm / addmm: counted there, not twice


def test_gemm_table_groups_the_step_gemms_by_shape():
    """Two profiled steps of a forward + backward through a linear and a GEMM accumulating in place: one row a
    GEMM op and shapes (the backward's weight-gradient mm included, the ``linear`` that called the forward's
    not), once a step, with the FLOPs of its shapes."""
    from benchmarks.harness.profile_step import StepProfiler
    prof = StepProfiler(skip=1, active=2, device=torch.device("cpu"))
    a, w, acc = torch.randn(96, 32), torch.randn(48, 32, requires_grad=True), torch.zeros(48, 32)
    for _ in range(3):
        torch.nn.functional.linear(a, w).square().sum().backward()
        acc.addmm_(w.detach(), a.T @ a)
        prof()
    rows = {(g["op"], tuple(tuple(s) for s in g["shapes"])): g for g in prof.summary()["gemms"]}
    assert set(rows) == {("aten::mm", ((96, 32), (32, 48))),           # the forward
                         ("aten::mm", ((48, 96), (96, 32))),           # the weight gradient
                         ("aten::mm", ((32, 96), (96, 32))),           # a.T @ a
                         ("aten::addmm_", ((48, 32), (48, 32), (32, 32)))}
    for (op, shapes), g in rows.items():
        assert g["calls_per_step"] == 1 and g["ms_per_step"] > 0
        flops = 2 * shapes[-2][0] * shapes[-2][1] * shapes[-1][1]
        assert g["gflop_per_call"] == pytest.approx(flops / 1e9)
        assert g["tflops"] == pytest.approx(flops / (g["ms_per_step"] * 1e-3) / 1e12)


def test_gemm_table_on_a_gpu_counts_each_calls_own_gemm_kernels():
    """On a GPU a GEMM call's time is the GEMM kernels it launched, not its ``device_time_total``, which held other
    time at the LM head (BENCHMARKS.md, "Training step breakdown"): a kernel of another kind attached to the call is
    not counted. Profiler events as torch builds them from a CUDA trace."""
    from torch.autograd.profiler_util import FunctionEvent

    from benchmarks.harness.profile_step import gemm_table
    events = []
    for i in range(4):  # two profiled steps, two calls a step
        evt = FunctionEvent(id=i, name="aten::mm", thread=0, start_us=0, end_us=10,
                            input_shapes=[[16384, 1024], [1024, 128256]])
        evt.append_kernel("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", 0, 6500)
        evt.append_kernel("_cross_entropy_kernel", 0, 3000)
        events.append(evt)
    (row,) = gemm_table(events, steps=2, cuda=True)
    assert row["calls_per_step"] == 2 and row["ms_per_step"] == pytest.approx(13.0)
    assert row["tflops"] == pytest.approx(2 * 16384 * 1024 * 128256 / 6.5e-3 / 1e12)


def test_profile_counts_kernels_only():
    """The GPU-side ``ProfilerStep#N`` range spans a whole step; counted as a kernel it doubled the total."""
    from benchmarks.harness.profile_step import is_kernel_row
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    assert is_kernel_row("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", cuda)
    assert not is_kernel_row("ProfilerStep*", cuda)
    assert not is_kernel_row("my_range", cuda, is_user_annotation=True)
    assert not is_kernel_row("aten::mm", cpu)


def test_saved_activations_counts_what_autograd_keeps():
    """SwiGLU MLP on the torch path, bf16: the input x [d] for the two projections, gate and up [ffn] each, silu(gate)
    [ffn] for the product, and the product [ffn] for down_proj: 2 bytes x (d + 4 ffn) per token, weights excluded;
    per step, whatever the length, the concatenated gate | up weight of the fused projection, 2 bytes x 2 ffn x d."""
    from benchmarks.harness.mixers import SHAPES_300M
    from benchmarks.harness.saved_activations import saved_bytes_per_token
    d, ffn = SHAPES_300M["hidden_size"], SHAPES_300M["intermediate_size"]
    counted = saved_bytes_per_token("mlp", seq=64)
    assert counted["bytes_per_token"] == 2 * (d + 4 * ffn)
    assert counted["bytes_per_step"] == 2 * 2 * ffn * d
