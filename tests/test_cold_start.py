"""The first-step notice (hybridlm.training.cold_start): on CUDA it says that fla's kernels compile and
autotune and where Triton caches them, empty or not; on CPU it says nothing."""
import torch

from hybridlm.training.cold_start import first_step_done, first_step_notice, triton_cache_dir


def test_cpu_prints_nothing():
    assert first_step_notice(torch.device("cpu")) is None
    assert first_step_done(torch.device("cpu"), 1.0) is None


def test_cuda_notice_names_the_cache_and_whether_it_is_warm(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert triton_cache_dir() == cache
    cold = first_step_notice(torch.device("cuda"))
    assert "autotuning" in cold and str(cache) in cold and "is empty" in cold
    (cache / "abc").mkdir(parents=True)
    warm = first_step_notice(torch.device("cuda", 0))
    assert str(cache) in warm and "has entries" in warm and "is empty" not in warm
    assert first_step_done(torch.device("cuda"), 151.04) == \
        "first step done in 151.0 s (compilation and autotuning included); the steady rate follows"


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert triton_cache_dir() == tmp_path / ".triton" / "cache"
