"""The `gpu` tests run with the shipped kernel tuning in place (hybridlm/ops/tuning.py), as a model's Triton path puts
it in place on first use: kernels a test calls directly are then served from the shipped file, and recorded under
``HYBRIDLM_RECORD_TUNING``, like a model's. (The hook is not in the kernel modules themselves: a line added above a
kernel changes Triton's hash of it, which covers its starting line, and voids its shipped entries.)"""
import pytest
import torch

from hybridlm.ops.tuning import apply_shipped_tuning


@pytest.fixture(scope="session", autouse=True)
def shipped_tuning():
    if torch.cuda.is_available():
        apply_shipped_tuning()
