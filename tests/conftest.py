import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu") if not torch.cuda.is_available() else None

# One intra-op thread in this process and (through the environment) in every subprocess: the tests' tensors
# are tiny, and on a 2-core machine with other load a second OpenMP thread makes each op wait for the busy
# core (measured: a [64, 32] linear 0.014 ms with one thread, 14 ms with two; a tiny pre-training run 3x the
# CPU time). OMP_NUM_THREADS set by the caller wins.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def demo_file(name: str) -> Path:
    """A real record file (``alpaca_en_demo.json``, ``dpo_en_demo.json``, ``c4_demo.jsonl``: the asset of the same
    stem, from the pinned PyPI sdist of llamafactory, fetched into the cache on first use), or a test failure
    naming it: a test that needs it must not pass by being skipped."""
    from hybridlm.data.cache import AssetError
    from hybridlm.data.record_sets import RECORD_SETS, record_file
    stem = Path(name).stem
    if stem not in RECORD_SETS:
        pytest.fail(f"{name}: no such record asset (known: {', '.join(RECORD_SETS)})", pytrace=False)
    try:
        return record_file(stem)
    except AssetError as e:
        pytest.fail(f"{name}: {e}", pytrace=False)


RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def subprocess_env(**extra) -> dict:
    """Environment for a CLI subprocess on CPU: the repo importable, DeepSpeed on CPU, and without the
    rendezvous variables a process group opened by an earlier test leaves in os.environ."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def run_under_interpreter(commands: dict, timeout: int = 600) -> dict:
    """Run each ``name: argv`` under Triton's interpreter (``TRITON_INTERPRET=1``), all at once, and return ``name:``
    the JSON on its last stdout line; a failed run fails the caller with its stderr."""
    procs = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=subprocess_env(TRITON_INTERPRET="1"))
             for name, argv in commands.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def interpreter_run_of(test_file: str):
    """A module-scoped fixture for a kernel test file: the JSON that ``python <test_file>`` prints on its last line
    under Triton's interpreter (the file's ``__main__`` runs its kernel cases)."""
    @pytest.fixture(scope="module")
    def interpreter_run():
        return run_under_interpreter({"kernel": [sys.executable, test_file]})["kernel"]
    return interpreter_run


def interpreter_rounds_like_gpu():
    """Under the interpreter, round fp32 -> bf16 as compiled Triton does (tests/support/triton_interpreter.py)."""
    from tests.support.triton_interpreter import round_bf16_like_gpu
    round_bf16_like_gpu()


def pytest_configure(config):
    """The `gpu` tests under Triton's interpreter (``TRITON_INTERPRET=1`` without CUDA) run in this process: the
    interpreter's patches go in before anything imports triton (tests/support/gpu_path.py)."""
    from tests.support import gpu_path
    if gpu_path.INTERPRETED:
        from tests.support.triton_interpreter import enable, poison_uninitialized_memory, round_bf16_like_gpu
        enable()
        round_bf16_like_gpu()
        poison_uninitialized_memory()


def pytest_collection_modifyitems(config, items):
    """A `gpu` test runs on CUDA; without CUDA, under the interpreter unless tests/support/gpu_path.py lists it as
    CUDA-only (then skipped with the reason listed there); otherwise skipped."""
    from tests.support import gpu_path
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            reason = gpu_path.skip_reason(item.nodeid)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def austen_data(tmp_path_factory):
    """The real embedded-default corpus (Jane Austen, Llama-3.2 tokenizer), prepared once per test run."""
    from hybridlm.data import DataConfig, ensure_prepared
    out = tmp_path_factory.mktemp("data") / "austen"
    ensure_prepared(DataConfig(path=str(out), sources=["asset:janeausten"], tokenizer="asset:llama3.2",
                               seq_len=32, num_proc=1), progress=False)
    return out


def tiny_config(pattern="*-G-K-S-", mixer="gdn", **overrides):
    """A small hybrid with every sublayer kind; shapes only, random weights."""
    from hybridlm.model import HybridConfig
    from hybridlm.model.runtime import RUNTIME_KEYS
    runtime = {"backend": "torch", **{k: overrides.pop(k) for k in list(overrides) if k in RUNTIME_KEYS}}
    values = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, hybrid_override_pattern=pattern, mixer=mixer,
        runtime=runtime,
        mla=dict(num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=16, rope_theta=10000.0),
        gdn=dict(num_heads=2, head_dim=16, num_v_heads=4, head_v_dim=8),
        kda=dict(num_heads=2, head_dim=16, num_v_heads=2, head_v_dim=16),
        mamba2=dict(d_state=16, head_dim=16, n_groups=2, expand=2),
    )
    values.update(overrides)
    return HybridConfig(**values)


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield


def greedy_decode(model, ids, new, cache=None, mask=None, forced=None, next_mask_column=None):
    """The decode tests' loop: the prompt ``ids`` then ``new - 1`` cached steps, step ``i`` fed the last argmax or
    ``forced[:, i]``. With a static ``cache`` the steps go through GraphedDecoder (a captured CUDA graph on CUDA,
    eager steps on a CPU); without one, through the dynamic cache under ``mask``, which grows by
    ``next_mask_column(i, mask)`` (default: a column of ones) at every step. Returns tokens ``[B, new]``, logits
    ``[B, new, vocab]``, the cache and the decoder (None on the dynamic path)."""
    from hybridlm.model.graphs import GraphedDecoder
    decoder = None
    if cache is not None:
        decoder = GraphedDecoder(model, cache)
        logits = [model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1:]]
    else:
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache, logits = out.cache, [out.logits[:, -1:]]
    tokens = [logits[0][:, -1].argmax(-1, keepdim=True)]
    for i in range(new - 1):
        nxt = tokens[-1] if forced is None else forced[:, i:i + 1]
        if decoder is not None:
            step = decoder.step(nxt).clone()  # the graph's output buffer: overwritten by the next step
        else:
            if mask is not None:
                column = torch.ones_like(mask[:, :1]) if next_mask_column is None else next_mask_column(i, mask)
                mask = torch.cat([mask, column], 1)
            step = model(input_ids=nxt, attention_mask=mask, cache=cache).logits
        logits.append(step)
        tokens.append(step[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1), torch.cat(logits, 1), cache, decoder


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b`` in fp64 (on the CPU: the two may live on different devices)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise error of ``a`` against ``b``, relative to ``b``'s largest magnitude (at least 1)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


def kernel_case_row(got, want, **fields) -> dict:
    """One interpreter case's JSON row: the kernel's outputs and gradients against the twin's (their count, each one's
    :func:`max_rel_err`, and whether dtypes and shapes agree), plus ``fields``."""
    return {**fields, "n": len(got), "n_want": len(want), "errors": [max_rel_err(g, w) for g, w in zip(got, want)],
            "dtypes_ok": all(g.dtype == w.dtype and g.shape == w.shape for g, w in zip(got, want))}


# pretrain.py overrides of a tiny model of every sublayer kind (test_pretrain, test_fault_campaign)
TINY_MODEL = [
    "model.hidden_size=32", "model.intermediate_size=64",
    "model.mla={num_heads: 2, q_lora_rank: 16, kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 16}",
    "model.gdn={num_heads: 2, head_dim: 8, num_v_heads: 2, head_v_dim: 8}",
    "model.kda={num_heads: 2, head_dim: 8, num_v_heads: 2, head_v_dim: 8}",
    "model.mamba2={d_state: 8, head_dim: 16, n_groups: 2, expand: 2}",
    "runtime.loss_chunks=1",  # 64 tokens a micro-batch: one chunk of the 128k-vocabulary loss, not eight
]

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def save_sharded_llama3_teacher(out, num_layers: int, num_heads: int, head_dim: int):
    """A tiny random Llama as users hold Llama-3.x: untied head, 2 KV heads, llama3 RoPE scaling, saved by
    transformers as two safetensors shards with the real Llama-3.2 tokenizer. Returns (directory, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from hybridlm.data import load_tokenizer
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      num_key_value_heads=2, head_dim=head_dim, vocab_size=len(tok), tie_word_embeddings=False,
                      max_position_embeddings=512, rope_theta=500000.0, rope_scaling=dict(LLAMA3),
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, max_shard_size="40MB")  # embeddings and head are 33 MB each in fp32
    tok.save_pretrained(out)
    assert len(list(Path(out).glob("model-*-of-*.safetensors"))) == 2
    return out, model


def save_tiny_llama(out, num_layers: int = 4):
    """A tiny random LlamaForCausalLM with the real Llama-3.2 tokenizer, saved as a teacher directory."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from hybridlm.data import load_tokenizer
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tok), tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_route_overrides(tmp_path, stages=("ild", "kd", "dpo"), steps: int = 1) -> list:
    """``upcycle run`` overrides of configs/upcycle/smollm2_route_cpu.yaml for a tiny random Llama teacher (made in
    ``tmp_path/teacher``) on the alpaca / DPO demo records: ``steps`` steps a training stage of ``stages``, one
    validation batch, a small calibration; the route writes into ``tmp_path/route``. Each stage runs and hands on a
    loadable model."""
    for name in ("dpo_en_demo.json", "alpaca_en_demo.json"):
        demo_file(name)
    teacher = save_tiny_llama(tmp_path / "teacher")
    small = ["optim.micro_batch_size=2", "optim.global_batch_size=2", f"optim.max_steps={steps}",
             "optim.warmup_steps=1", "run.progress=false", "run.eval_interval=0", "run.save_interval=0",
             "data.val_max_batches=1"]
    overrides = [f"output_dir={tmp_path / 'route'}", f"teacher={teacher}", "init.kv_lora_rank=32",
                 "init.qk_rope_head_dim=8", "init.calib_tokens=512", "init.calib_seq_len=64",
                 f"ild.data.path={tmp_path / 'data'}", "ild.data.sources=[asset:alpaca_en_demo]",
                 "ild.data.seq_len=32", "smart.n_mla=2", "smart.batches=1", "smart.batch_size=2",
                 "kd.data.path=asset:alpaca_en_demo", "kd.data.max_length=64",
                 "dpo.data.path=asset:dpo_en_demo", "dpo.data.max_length=64",
                 "dpo.data.max_prompt_length=32", "report.seq_len=32", "report.max_tokens=256"]
    return overrides + [f"{stage}.{o}" for stage in stages for o in small]


def assert_chart(path, min_side: int = 200) -> None:
    """``path`` is a decodable PNG of at least ``min_side`` pixels a side with something drawn on it (not a
    blank canvas): the check a report's picture gets beyond existing."""
    import matplotlib.image as mpimg
    img = mpimg.imread(str(path))
    assert img.ndim == 3 and min(img.shape[:2]) >= min_side, (path, img.shape)
    assert img[..., :3].std() > 0.01, f"{path}: blank"


def count_graphed_generate(monkeypatch) -> list:
    """Record the keyword arguments of every call ``generate()`` makes to the fast path's ``graphed_generate``
    (which still runs): the list it returns grows by one dict a call."""
    from hybridlm.model import modeling
    calls = []
    original = modeling.graphed_generate

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "graphed_generate", counting)
    return calls


@pytest.fixture(scope="session", autouse=True)
def shipped_kernel_tuning():
    """On a CUDA host the shipped kernel tuning is in place for every test (hybridlm/ops/tuning.py), as a model's
    build puts it in place: kernels a test calls directly are then served from the shipped
    file, and recorded under HYBRIDLM_RECORD_TUNING, like a model's. (Not in the kernel modules themselves: a line
    added above a kernel changes Triton's hash of it, which covers its starting line, and voids its entries.)"""
    if torch.cuda.is_available():
        from hybridlm.ops.tuning import apply_shipped_tuning
        apply_shipped_tuning()


@pytest.fixture(autouse=True)
def no_stop_request_between_tests():
    """A CLI called in-process owns the stop signals until it returns; a test that ends otherwise (or sends itself
    a signal) must not hand the handler or a recorded request to the next test."""
    from hybridlm.training.preempt import STOP

    def clear():
        STOP.uninstall()
        STOP.answered()

    clear()
    yield
    clear()
