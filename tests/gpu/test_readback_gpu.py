"""The Readback on a GPU (hybridlm/utils/readback.py): it reads the values as they were when it was made, waits
for the work launched before it and not for the work launched after (needs CUDA; the CPU twin is
tests/test_step_readback.py)."""
import time

import pytest
import torch

from hybridlm.utils.readback import Readback

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_readback_waits_for_the_work_before_it_only():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 100
    values = torch.arange(4, dtype=torch.float64, device="cuda")
    Readback(values).tolist()  # any first-use cost (the pinned allocator, the copy) before the case
    torch.cuda.synchronize()
    values.add_(1)                      # launched before: part of what is read
    rb = Readback(values)
    for _ in range(200):                # launched after (~0.3 s of GEMMs on an H200): not waited for
        torch.mm(a, a)
    values.mul_(100)                    # nor does it reach what is read
    assert rb.tolist() == [1.0, 2.0, 3.0, 4.0] and rb.ready()
    assert not torch.cuda.current_stream().query()  # the later GEMMs are still running
    torch.cuda.synchronize()
    assert values.tolist() == [100.0, 200.0, 300.0, 400.0]


def test_a_stamp_times_the_device_work_between_two_stamps():
    from hybridlm.utils.readback import Stamp
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 100
    torch.mm(a, a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start = Stamp(a.device)
    for _ in range(100):
        torch.mm(a, a)
    end = Stamp(a.device)
    torch.cuda.synchronize()
    host = time.perf_counter() - t0
    device = end.seconds_since(start)
    assert 0 < device <= host and device > 0.5 * host  # the GEMMs' time, not the launches'
