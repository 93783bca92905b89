"""The Readback on a GPU (hybridlm/utils/readback.py): it reads the values as they were when it was made, waits
for the work launched before it and not for the work launched after (needs CUDA; the CPU twin is
tests/test_step_readback.py)."""
import pytest
import torch

from hybridlm.utils.readback import Readback

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 2_000_000_000  # about a second of one GPU thread spinning


def test_readback_waits_for_the_work_before_it_only():
    values = torch.arange(4, dtype=torch.float64, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES // 4)
    values.add_(1)                     # launched before: part of what is read
    rb = Readback(values)
    torch.cuda._sleep(SLEEP_CYCLES)    # launched after: not waited for
    values.mul_(100)                   # nor does it reach what is read
    assert rb.tolist() == [1.0, 2.0, 3.0, 4.0] and rb.ready()
    assert not torch.cuda.current_stream().query()  # the later sleep is still running
    torch.cuda.synchronize()
    assert values.tolist() == [100.0, 200.0, 300.0, 400.0]
