"""``optim.step_on_device`` (``DeepSpeedAdapter.step_on_device``) with the engine on a GPU (needs CUDA): the CPU
tests of tests/test_engine.py again, now through CUDA's fused AdamW, whose ``found_inf`` must skip a non-finite step
(weights, fp32 masters, moments and step count bit-identical) and whose steps must train as DeepSpeed's own bf16
step does. The engine takes the GPU wherever there is one."""
import pytest
import torch

import engine_worker as W
from hybridlm.engine import Engine
from test_engine import test_step_on_device_skips_as_deepspeed_does as skips_as_deepspeed_does
from test_engine import test_step_on_device_trains_as_deepspeeds_step as trains_as_deepspeeds_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_engine_steps_on_the_gpu():
    eng = Engine(W.build_model(), W.make_config("bf16", step_on_device=True), W.loss_fn)
    try:
        assert eng.device.type == "cuda" and next(eng.module.parameters()).is_cuda
        assert all(p.is_cuda for p in eng.optimizer.fp32_groups_flat_partition)
    finally:
        eng.ds_engine.destroy()


def test_a_nonfinite_step_is_skipped_on_the_gpu():
    skips_as_deepspeed_does()


def test_steps_train_as_deepspeeds_on_the_gpu():
    trains_as_deepspeeds_step()
