"""The Readback on a GPU (hybridlm/utils/readback.py): it reads the values as they were when it was made, waits
for the work launched before it and not for the work launched after (needs CUDA; the CPU twin is
tests/test_step_readback.py)."""
import time

import pytest
import torch

from hybridlm.utils.readback import Readback

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _read_behind_later_work(a, values):
    """Read ``values`` + 1 through a Readback made before ~0.3 s of GEMMs (on an H200) and a change of
    ``values``: what was read, whether the GEMMs were still running once it was read, and the host / device
    times of the case (for the failure message)."""
    values.add_(1)                      # launched before: part of what is read
    rb = Readback(values)
    t0 = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):                # launched after: not waited for
        torch.mm(a, a)
    end.record()
    values.mul_(100)                    # nor does it reach what is read
    launched = time.perf_counter()
    got, ready = rb.tolist(), rb.ready()
    read = time.perf_counter()
    running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    timing = (f"launches {launched - t0:.3f} s, read {read - launched:.3f} s, "
              f"GEMMs on the device {start.elapsed_time(end) / 1e3:.3f} s")
    return got, ready, running, timing


def test_readback_waits_for_the_work_before_it_only():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 100
    values = torch.zeros(4, dtype=torch.float64, device="cuda")
    # a dry run first, so that every kernel of the case has been loaded: CUDA loads a kernel at its first launch
    # (lazy loading), and the load may wait for the work running then, which the case must not (a case that
    # launched values.mul_ for the first time behind the GEMMs waited for them: BENCHMARKS.md, "Test suites")
    _read_behind_later_work(a, values)
    values.copy_(torch.arange(4, dtype=torch.float64))
    torch.cuda.synchronize()
    got, ready, running, timing = _read_behind_later_work(a, values)
    assert got == [1.0, 2.0, 3.0, 4.0] and ready, timing
    assert running, timing              # the later GEMMs are still running
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
