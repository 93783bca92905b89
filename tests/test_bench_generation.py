"""The generation-throughput benchmark on CPU: a tiny random Llama teacher and a tiny upcycled-shape
hybrid (MLA + Mamba2 layers from ``upcycle.student.student_config``), fp32.

Checks that the timed loop is real greedy decoding (equal to ``generate`` and to full forwards), that every
entry is measured, that the cache bytes are exactly what the MLA / GQA shapes predict (and the KV ratio is
kv_report's), and that an out-of-memory entry stops the larger batches.
"""
import json

import pytest
import torch

from conftest import save_tiny_llama, assert_chart
from benchmarks.harness import generation as G
from hybridlm.model import HybridForCausalLM
from hybridlm.model.generate import greedy_generate
from hybridlm.model.runtime import RuntimeSettings

KINDS = ["mla", "mamba2", "mla", "mamba2"]
KV_RANK, ROPE = 16, 8
PROMPTS, NEW, BATCHES = (16, 32), 8, (1, 2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: one intra-op thread is faster, and steady on a shared CPU (no OpenMP spin-waits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaConfig
    from upcycle.student import student_config
    root = tmp_path_factory.mktemp("bench_gen")
    teacher = save_tiny_llama(root / "teacher", num_layers=len(KINDS))
    cfg = student_config(LlamaConfig.from_pretrained(teacher), KINDS, kv_lora_rank=KV_RANK, qk_rope_head_dim=ROPE)
    torch.manual_seed(0)
    HybridForCausalLM(cfg).save_pretrained(root / "hybrid")
    return root, teacher, root / "hybrid"


@pytest.fixture(scope="module")
def report(models):
    root, teacher, hybrid = models
    argv = ["--hybrid", str(hybrid), "--teacher", str(teacher), "--prompt-lens", *map(str, PROMPTS),
            "--new-tokens", str(NEW), "--batches", *map(str, BATCHES), "--dtype", "fp32", "--out", str(root / "out"),
            "--warmup-steps", "1", "--check-generate", str(NEW)]
    return G.main(argv), root / "out"


def test_every_entry_measured_and_written(report):
    rep, out = report
    on_disk = json.loads((out / "generation.json").read_text())
    assert_chart(out / "generation.png")
    assert on_disk["entries"] == json.loads(json.dumps(rep["entries"]))
    assert {(e["model"], e["prompt_len"], e["batch"]) for e in on_disk["entries"]} == {
        (m, p, b) for m in G.MODELS for p in PROMPTS for b in BATCHES}
    for e in on_disk["entries"]:
        assert e["status"] == "ok" and e["decode_steps"] == NEW - 1 and e["cached_tokens"] == e["prompt_len"] + NEW - 1
        for key in ("decode_tokens_per_s", "e2e_tokens_per_s", "prefill_tokens_per_s", "prefill_s", "decode_s"):
            assert e[key] > 0, key
        if e["batch"] == BATCHES[0]:  # the loop's tokens are generate()'s and full forwards', for both models
            assert e["matches_generate"] is True, (e["model"], e["prompt_len"])
            assert e["generate_agree_tokens"] == e["full_forward_agree_tokens"] == e["check_tokens"] == NEW
        else:
            assert "check_tokens" not in e
    assert len(on_disk["comparisons"]) == len(PROMPTS) * len(BATCHES)
    assert on_disk["models"]["teacher"]["attn_implementation"] == "sdpa"
    assert on_disk["target"]["status"].startswith("not measured")


def test_cache_bytes_match_the_shapes(report, models):
    rep, _ = report
    _, teacher_dir, hybrid_dir = models
    hybrid = HybridForCausalLM.from_pretrained(hybrid_dir)
    tcfg = json.loads((teacher_dir / "config.json").read_text())
    n_mla = KINDS.count("mla")
    recurrent_per_seq = 0  # Mamba2: fp32 state [H, d_state, head_dim] + conv state [conv_dim, width] (fp32 model)
    for block in hybrid.model.layers:
        if block.kind == "mamba2":
            m = block.mixer
            recurrent_per_seq += 4 * (m.num_heads * m.d_state * m.head_dim + m.conv_dim * m.conv1d.weight.shape[-1])
    recurrent = {}
    for e in rep["entries"]:
        tokens = e["batch"] * e["cached_tokens"]
        if e["model"] == "hybrid":
            assert e["cache_bytes_kv"] == n_mla * (KV_RANK + ROPE) * 4 * tokens == e["predicted_cache_bytes_kv"]
            assert e["cache_bytes_recurrent"] == e["batch"] * recurrent_per_seq  # constant in the length
            assert e["cache_bytes"] == e["cache_bytes_kv"] + e["cache_bytes_recurrent"]
            recurrent.setdefault(e["batch"], set()).add(e["cache_bytes_recurrent"])
        else:
            want = 2 * tcfg["num_hidden_layers"] * tcfg["num_key_value_heads"] * tcfg["head_dim"] * 4 * tokens
            assert e["cache_bytes"] == e["cache_bytes_kv"] == want == e["predicted_cache_bytes_kv"]
    assert all(len(v) == 1 for v in recurrent.values())
    predicted = (2 * tcfg["num_key_value_heads"] * tcfg["head_dim"] * tcfg["num_hidden_layers"]) / (n_mla * (KV_RANK + ROPE))
    assert rep["kv_prediction"]["compression"] == pytest.approx(predicted)
    for row in rep["comparisons"]:
        assert row["kv_ratio_measured"] == pytest.approx(predicted) and row["kv_ratio_predicted"] == pytest.approx(predicted)
        assert row["cache_ratio_total"] < row["kv_ratio_measured"]  # the recurrent states count in the total


def test_timed_loop_is_greedy_decoding(models):
    _, _, hybrid_dir = models
    model = G.load_hybrid(str(hybrid_dir), torch.float32, torch.device("cpu"))
    ids = G.make_prompts(2, 12, model.config.vocab_size, seed=3, device=torch.device("cpu"))
    run = G.greedy_decode(model, ids, NEW)
    assert run.tokens.shape == (2, NEW) and run.cache.get_seq_length() == 12 + NEW - 1
    assert torch.equal(run.tokens, G.generate_reference(model, ids, NEW))
    assert torch.equal(run.tokens, greedy_generate(model, ids, NEW)[:, 12:])  # full forwards, no cache


def test_oom_stops_larger_batches(models, tmp_path, monkeypatch):
    _, teacher, hybrid = models
    real = G.greedy_decode

    def fake(model, ids, new_tokens, run=None):
        if ids.shape[0] >= 2:
            if run is not None:
                run.phase = "decode"
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(model, ids, new_tokens, run)

    monkeypatch.setattr(G, "greedy_decode", fake)
    rep = G.main(["--hybrid", str(hybrid), "--teacher", str(teacher), "--models", "hybrid", "--prompt-lens", "8",
                  "--new-tokens", "2", "--batches", "1", "2", "4", "--out", str(tmp_path), "--warmup-steps", "0"])
    assert [(e["batch"], e["status"]) for e in rep["entries"]] == [(1, "ok"), (2, "oom")]
    assert rep["entries"][1]["oom_phase"] == "decode"
    assert_chart(tmp_path / "generation.png")
    merged = G.main(["--merge", str(tmp_path / "generation.json"), "--out", str(tmp_path / "merged")])
    assert len(merged["entries"]) == 2
    assert_chart(tmp_path / "merged" / "generation.png")


def test_cuda_graph_option_decodes_through_the_static_cache(models, tmp_path, monkeypatch):
    """``--cuda-graph``: the hybrid decodes through a static HybridCache (+ GraphedDecoder; on CPU its eager
    fallback) and still produces generate()'s tokens; the teacher keeps its default path; recorded per entry.
    The decode-kernel flags are the measured hybrid's runtime settings, nothing process-wide."""
    _, teacher, hybrid = models
    loaded = []
    load_hybrid = G.load_hybrid

    def load_and_keep(*args):
        loaded.append(load_hybrid(*args))
        return loaded[-1]

    monkeypatch.setattr(G, "load_hybrid", load_and_keep)
    rep = G.main(["--hybrid", str(hybrid), "--teacher", str(teacher), "--prompt-lens", "8", "--new-tokens", str(NEW),
                  "--batches", "2", "--dtype", "fp32", "--out", str(tmp_path), "--warmup-steps", "1",
                  "--check-generate", str(NEW), "--cuda-graph", "--mla-split-k", "off", "--profile-decode", "2",
                  "--graph-small-kernels", "off", "--graph-fuse-residual", "off"])
    assert rep["cuda_graph"] is True and rep["mla_split_k"] == "off" and rep["profile_decode"] == 2
    assert rep["graph_small_kernels"] == "off" and rep["graph_fuse_residual"] == "off"
    assert rep["mamba2_fused_step"] == "on"
    # the flags set the loaded model's runtime (on CPU the Triton kernels are not taken either way)
    (measured,) = loaded
    runtime = measured.runtime
    assert (runtime.mamba2_fused_step, runtime.mla_split_k_decode) == (True, False)
    assert (runtime.graph_small_kernels, runtime.graph_fuse_residual) == (False, False)
    assert all(m.runtime is runtime for m in measured.modules() if "runtime" in vars(m))
    by_model = {e["model"]: e for e in rep["entries"]}
    h, t = by_model["hybrid"], by_model["teacher"]
    assert h["status"] == "ok" and h["cuda_graph"] is True and h["graph_replayed"] is False
    assert h["decode_path"].startswith("static HybridCache")
    # the profiled steps (CPU: op self time): every step's ops counted, the model's matmuls among them
    prof = h["decode_profile"]
    assert prof["profiled_steps"] == 2 and prof["ms_per_step"] > 0 and prof["calls_per_step"] > 10
    assert any(c["category"] == "matmul (GEMM)" and c["ms_per_step"] > 0 for c in prof["categories"])
    assert "decode_profile" not in t
    assert 0 <= h["graph_capture_s"] < 0.5  # no graph on CPU: capture() returns at once
    assert h["matches_generate"] is True and h["full_forward_agree_tokens"] == NEW
    assert t["cuda_graph"] is False and "decode_path" not in t and t["matches_generate"] is True
    # the static cache is exactly full after the run: allocated bytes are the used ones, as the dynamic cache's
    n_mla = KINDS.count("mla")
    assert h["cache_bytes_kv"] == n_mla * (KV_RANK + ROPE) * 4 * h["batch"] * h["cached_tokens"]

    model = load_hybrid(str(hybrid), torch.float32, torch.device("cpu"))
    assert model.runtime == RuntimeSettings()  # another model loaded after the run: the defaults
    ids = G.make_prompts(2, 12, model.config.vocab_size, seed=3, device=torch.device("cpu"))
    run = G.greedy_decode(model, ids, NEW, cuda_graph=True)
    assert run.cache.is_static and run.cache.get_seq_length() == run.cache.max_length == 12 + NEW - 1
    assert torch.equal(run.tokens, G.greedy_decode(model, ids, NEW).tokens)


def test_via_generate_times_model_generate(models, tmp_path):
    """``--via generate``: both models through their own ``generate()`` (the teacher also with its StaticCache);
    the tokens are the loop's, the path taken is recorded (on a CPU the hybrid's generate is transformers' loop),
    and the decode time is an N-token call minus a 1-token call."""
    _, teacher, hybrid = models
    common = ["--hybrid", str(hybrid), "--teacher", str(teacher), "--prompt-lens", "8", "--new-tokens", str(NEW),
              "--batches", "2", "--dtype", "fp32", "--warmup-steps", "1", "--check-generate", str(NEW),
              "--via", "generate"]
    rep = G.main(common + ["--out", str(tmp_path / "dyn")])
    assert rep["via"] == "generate" and "generate()" in rep["method"]
    by_model = {e["model"]: e for e in rep["entries"]}
    h, t = by_model["hybrid"], by_model["teacher"]
    for e in (h, t):
        assert e["status"] == "ok" and e["decode_via"] == "generate" and e["matches_generate"] is True
        assert e["full_forward_agree_tokens"] == NEW and e["cache_bytes"] is None
        assert e["decode_s"] > 0 and e["decode_ms_per_step"] == pytest.approx(1e3 * e["decode_s"] / (NEW - 1))
        assert e["first_call_s"] > 0  # the warm-up: one call of the timed shape
    assert h["decode_path"] == "generate(): transformers' eager loop (not on CUDA)"
    assert t["generate_kwargs"] == {} and rep["comparisons"][0]["kv_ratio_measured"] is None
    assert_chart(tmp_path / "dyn" / "generation.png")

    static = G.main(common + ["--models", "teacher", "--teacher-cache", "static", "--out", str(tmp_path / "static")])
    (e,) = static["entries"]
    assert e["generate_kwargs"] == {"cache_implementation": "static"} and e["matches_generate"] is True

    model = G.load_hybrid(str(hybrid), torch.float32, torch.device("cpu"))
    ids = G.make_prompts(2, 12, model.config.vocab_size, seed=3, device=torch.device("cpu"))
    run = G.generate_decode(model, ids, NEW)
    assert torch.equal(run.tokens, G.greedy_decode(model, ids, NEW).tokens) and run.cache is None
