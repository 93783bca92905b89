"""Autotune results shipped with the package (hybridlm/ops/tuning.py): a tuned launch recorded, made into a tuning
file, and served to a real Triton autotuner without timing anything, only where kernel source, tuning key and
candidates match; a file for another GPU or Triton, or a damaged one, ignored with one line; every shipped file
valid. Triton's own timing (``check_disk_cache``, which needs a GPU) is stood in for by a function that picks the
fastest of given timings, as Triton's does."""
import json
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from hybridlm import patches
from hybridlm.ops import tuning as T

GPU = "NVIDIA H200"
CONFIGS = [triton.Config({"BLOCK": 64}, num_warps=4), triton.Config({"BLOCK": 128}, num_warps=8)]
TIMINGS = {64: [0.031, 0.030, 0.032], 128: [0.012, 0.011, 0.013]}  # the second candidate wins


@triton.jit
def scale_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)


@triton.jit
def scale_kernel_changed(x, y, n, BLOCK: tl.constexpr):  # renamed below: the same name, another source
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 3, mask=i < n)


scale_kernel_changed.fn.__name__ = "scale_kernel"  # JITFunction.__name__ reads its function's


def _autotuner(kernel=scale_kernel, configs=CONFIGS):
    return triton.autotune(configs, key=["n"], cache_results=True)(kernel)


def _timing_stand_in(self, tuning_key, configs, bench_fn):
    """Triton's check_disk_cache on a machine that times: no earlier result, so it times (bench_fn) and keeps the
    fastest candidate."""
    bench_fn()
    return False


def _bench_of(tuner, key, configs, calls):
    def bench():
        calls.append(key)
        tuner.configs_timings = {c: TIMINGS[c.kwargs["BLOCK"]] for c in configs}
        tuner.cache[key] = min(tuner.configs_timings, key=tuner.configs_timings.get)
    return bench


@pytest.fixture
def hooked(tmp_path, monkeypatch):
    """The serving check around the stand-in, recording into a JSONL file; the module's status reset after."""
    record = tmp_path / "tuning.jsonl"
    monkeypatch.setattr(T, "_STATUS", None)
    monkeypatch.setattr(T, "_RECORDING", (GPU, triton.__version__, str(record)))
    check = T.serving_check(_timing_stand_in)
    return check, record


def _launch(check, tuner, n, calls, configs=CONFIGS):
    key = (n, "torch.float32")
    used = check(tuner, key, configs, _bench_of(tuner, key, configs, calls))
    return used, tuner.cache[key]


def test_a_recorded_launch_is_served_from_the_made_file(hooked, tmp_path, monkeypatch):
    check, record = hooked
    calls = []
    used, best = _launch(check, _autotuner(), 1000, calls)
    assert not used and calls and best.kwargs == {"BLOCK": 128}
    line = json.loads(record.read_text())
    assert (line["gpu"], line["kernel"], line["key"]) == (GPU, "scale_kernel", str((1000, "torch.float32")))
    assert line["source"] == scale_kernel.cache_key and line["timing"] == TIMINGS[128]

    out = tmp_path / T.shipped_file(GPU, triton.__version__).name
    data = T.make_tuning_file(out, [record], GPU, triton.__version__)
    assert out.name == f"nvidia-h200.triton-{triton.__version__}.json" and len(data["entries"]) == 1
    assert T.read_tuning_file(out) == data

    monkeypatch.setattr(T, "_STATUS", T.load_tuning(out, GPU, triton.__version__))
    fresh, calls = _autotuner(), []  # a new process's autotuner: nothing in its cache
    used, best = _launch(check, fresh, 1000, calls)
    assert used and not calls, "served without timing"
    assert best.kwargs == {"BLOCK": 128} and best.num_warps == 8 and isinstance(best, triton.Config)
    assert (T.status().hits, T.status().misses) == (1, 0)
    assert T.status().served() == "shipped tuning served 1 autotuned kernels, 0 tuned afresh"


@pytest.mark.parametrize("change", ["source", "key", "candidates"])
def test_a_launch_that_differs_is_tuned_afresh(hooked, tmp_path, monkeypatch, change):
    check, record = hooked
    _launch(check, _autotuner(), 1000, [])
    out = tmp_path / "tuned.json"
    T.make_tuning_file(out, [record], GPU, triton.__version__)
    monkeypatch.setattr(T, "_STATUS", T.load_tuning(out, GPU, triton.__version__))
    calls = []
    if change == "source":
        _launch(check, _autotuner(scale_kernel_changed), 1000, calls)
    elif change == "key":
        _launch(check, _autotuner(), 4096, calls)
    else:
        configs = CONFIGS + [triton.Config({"BLOCK": 256}, num_warps=8)]
        TIMINGS[256] = [0.5, 0.5, 0.5]
        _launch(check, _autotuner(configs=configs), 1000, calls, configs)
    assert calls, f"a launch with another {change} must be timed"
    assert (T.status().hits, T.status().misses) == (0, 1)


@pytest.mark.parametrize("gpu,version", [("NVIDIA H100 80GB HBM3", triton.__version__), (GPU, "3.6.0")])
def test_another_gpu_or_triton_is_ignored_with_one_line(hooked, tmp_path, gpu, version):
    check, record = hooked
    _launch(check, _autotuner(), 1000, [])
    out = tmp_path / "tuned.json"
    T.make_tuning_file(out, [record], GPU, triton.__version__)
    status = T.load_tuning(out, gpu, version)
    assert status.table is None
    assert status.line == (f"kernel tuning: ignored tuned.json: made for {GPU} / Triton {triton.__version__}, this is "
                           f"{gpu} / Triton {version}; kernels autotune on first use")


@pytest.mark.parametrize("damage", ["edit", "truncate", "entry", "format"])
def test_a_damaged_file_is_refused_by_content(hooked, tmp_path, damage):
    check, record = hooked
    _launch(check, _autotuner(), 1000, [])
    out = tmp_path / "tuned.json"
    data = T.make_tuning_file(out, [record], GPU, triton.__version__)
    text = out.read_text()
    if damage == "edit":  # the winner's warps changed: valid JSON, the same size
        text = text.replace("\"num_warps\": 8", "\"num_warps\": 4")
    elif damage == "truncate":
        text = text[: len(text) // 2]
    elif damage == "entry":
        del data["entries"][0]["config"]
        data["sha256"] = T.entries_digest(data["entries"])
        text = json.dumps(data)
    else:
        text = text.replace(T.FORMAT, "something-else/1")
    assert text != out.read_text()
    out.write_text(text)
    status = T.load_tuning(out, GPU, triton.__version__)
    assert status.table is None and "\n" not in status.line
    assert status.line.startswith(f"kernel tuning: ignored {out}: ")
    expected = {"edit": "content does not match its sha256", "truncate": "not readable JSON",
                "entry": "entry 0 lacks one of", "format": "format is not"}[damage]
    assert expected in status.line


def test_make_merges_with_the_file_there_and_skips_other_gpus(hooked, tmp_path):
    check, record = hooked
    _launch(check, _autotuner(), 1000, [])
    out = tmp_path / "tuned.json"
    T.make_tuning_file(out, [record], GPU, triton.__version__)
    other = tmp_path / "more.jsonl"
    lines = [json.loads(record.read_text())]
    lines.append(dict(lines[0], key=str((2048, "torch.float32"))))
    lines.append(dict(lines[0], gpu="NVIDIA H100 80GB HBM3", key=str((7, "torch.float32"))))
    other.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"cut by a ki')
    data = T.make_tuning_file(out, [other], GPU, triton.__version__)
    assert sorted(e["key"] for e in data["entries"]) == [str((1000, "torch.float32")), str((2048, "torch.float32"))]


def test_every_shipped_file_is_valid():
    """The files in hybridlm/ops/tuned/ (package data): named for their GPU and Triton, each entry complete, the
    content matching its digest, each loading into a table for its own GPU and Triton."""
    files = T.shipped_files()
    if not files:
        pytest.skip("no tuning file in hybridlm/ops/tuned/ (made on a GPU: python -m hybridlm.training.kernel_cache "
                    "--help)")
    for path in files:
        data = T.read_tuning_file(path)
        assert path.name == T.shipped_file(data["gpu"], data["triton"]).name
        status = T.load_tuning(path, data["gpu"], data["triton"])
        assert status.table is not None and len(status.table) == len(data["entries"]) > 0, status.line
        print(status.line)


def _as_on_a_cuda_host(monkeypatch, tmp_path, gpu=GPU):
    """CUDA's presence and the device's name stood in for, a shipped file (no entries) for ``GPU`` in ``tmp_path``,
    the process's status cleared; Triton's autotuner put back as it is after the test."""
    monkeypatch.setattr(T, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(Autotuner, "check_disk_cache", Autotuner.check_disk_cache)  # restored after the test
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HYBRIDLM_SHIPPED_TUNING", raising=False)
    monkeypatch.delenv("HYBRIDLM_RECORD_TUNING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(T, "_STATUS", None)
    data = {"format": T.FORMAT, "gpu": GPU, "triton": triton.__version__, "fla": None, "entries": [],
            "sha256": T.entries_digest([])}
    T.shipped_file(GPU, triton.__version__).write_text(json.dumps(data))


def test_the_process_hook_says_one_line_once(tmp_path, monkeypatch, capsys):
    """apply_shipped_tuning on a CUDA host (CUDA's presence and the device's name stood in for): the matching shipped
    file loaded once, the autotuner hooked once, one line on stderr; no file for the GPU, one line."""
    _as_on_a_cuda_host(monkeypatch, tmp_path)
    original = Autotuner.check_disk_cache
    for gpu, expect in ((GPU, f"kernel tuning: 0 shipped autotune results for {GPU} / Triton {triton.__version__}"),
                        ("NVIDIA B200", f"kernel tuning: none shipped for NVIDIA B200 / Triton {triton.__version__} "
                                        f"(shipped: nvidia-h200.triton-{triton.__version__})")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, gpu=gpu: gpu)
        monkeypatch.setattr(T, "_STATUS", None)
        first, second = T.apply_shipped_tuning(), T.apply_shipped_tuning()
        err = capsys.readouterr().err
        assert first is second and err.count("\n") == 1 and err.startswith(expect), err
        # hooked once, by the patch, around Triton's own check (the second GPU's status has no table to serve)
        assert patches.installed_by(Autotuner.check_disk_cache) == "autotuner-shipped-results"
        assert Autotuner.check_disk_cache is not original
    monkeypatch.setenv("HYBRIDLM_SHIPPED_TUNING", "0")
    monkeypatch.setattr(T, "_STATUS", None)
    assert T.apply_shipped_tuning().line == "kernel tuning: shipped results off (HYBRIDLM_SHIPPED_TUNING=0)"


def test_the_cli_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "hybridlm.training.kernel_cache", "shipped"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "here: no CUDA GPU here" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "hybridlm.training.kernel_cache", "name"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: no CUDA GPU here"), out.stderr


def test_make_off_the_gpu_takes_the_gpu_the_records_name(tmp_path):
    """Records brought back from a GPU machine make its file anywhere; records of two GPUs are refused."""
    def record(gpu, key):
        return json.dumps({"gpu": gpu, "triton": "3.7.1", "fla": "0.6.0", "kernel": "k", "source": "s" * 64,
                           "key": key, "candidates": "c" * 16, "config": {"kwargs": {"BD": 64}, "num_warps": 4},
                           "timing": [0.1]}) + "\n"
    (tmp_path / "a.jsonl").write_text(record("NVIDIA H100 80GB HBM3", "(1,)") + record("NVIDIA H100 80GB HBM3", "(2,)")
                                      + '{"gpu": "NVIDIA H1')  # the last line cut by a killed run
    cli = [sys.executable, "-m", "hybridlm.training.kernel_cache", "make"]
    out = subprocess.run([*cli, str(tmp_path / "t.json"), "--records", str(tmp_path / "a.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    made = json.loads((tmp_path / "t.json").read_text())
    assert made["gpu"] == "NVIDIA H100 80GB HBM3" and [e["key"] for e in made["entries"]] == ["(1,)", "(2,)"]
    (tmp_path / "b.jsonl").write_text(record("NVIDIA H200", "(3,)"))
    out = subprocess.run([*cli, str(tmp_path / "u.json"), "--records", str(tmp_path / "a.jsonl"),
                          str(tmp_path / "b.jsonl")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "the records do not name one GPU and Triton version" in out.stderr, out.stderr
    assert not (tmp_path / "u.json").exists()


def test_a_model_build_puts_the_tuning_in_place_quietly(tmp_path, monkeypatch, capsys):
    """The explicit start: building a model on a CUDA host (stood in for) hooks the autotuner before any kernel can
    launch, reading nothing and asking no device (no CUDA context made at a build); the first launch that would time
    candidates loads the file for its GPU; nothing is said (the first-step notice says the line); the kernel choice
    itself (hybridlm/ops/backend.py) only answers."""
    from hybridlm.model import HybridConfig, HybridForCausalLM
    _as_on_a_cuda_host(monkeypatch, tmp_path)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or GPU)
    monkeypatch.setattr(Autotuner, "check_disk_cache", _timing_stand_in)  # Triton's own would need a driver
    assert T.status() is None
    HybridForCausalLM(HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, hybrid_override_pattern="*-",
                                   mla={"num_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                        "qk_rope_head_dim": 8}))
    assert patches.installed_by(Autotuner.check_disk_cache) == "autotuner-shipped-results"
    assert T.status() is None and not asked
    calls = []
    tuner, key = _autotuner(), (1000, "torch.float32")
    Autotuner.check_disk_cache(tuner, key, CONFIGS, _bench_of(tuner, key, CONFIGS, calls))
    assert calls and asked and T.status() is not None and T.status().table == {} and T.status().misses == 1
    assert capsys.readouterr().err == ""
