"""The idle-gap reader of Chrome traces (benchmarks/harness/trace_gaps.py) on a hand-made trace."""
import gzip
import json

import pytest

from benchmarks.harness.trace_gaps import analyse, load_events, main, merged_busy, short_frame

ROOT = "/opt/env/lib/python3.12/site-packages/"


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0 if cat in ("kernel", "gpu_memset") else 100,
            "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace():
    """Host thread 1: train_step [0, 400) calls the optimizer's loop [100, 300), which launches two kernels;
    before it, the forward launches one. GPU: kernels at [10, 90), [150, 160), [290, 330): gaps of 60 (ended by
    the optimizer's first launch) and 130 (its second), both traced to the optimizer's frame."""
    return [
        _x("user_annotation", "ProfilerStep#7", 0, 400),
        _x("python_function", "/work/p/hybridlm/engine/engine.py(340): train_step", 0, 400),
        _x("python_function", "/work/p/hybridlm/model/modeling.py(99): forward", 2, 20),
        _x("cpu_op", "aten::mm", 4, 8),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _x("python_function", ROOT + "deepspeed/runtime/bf16_optimizer.py(532): update_hp_grads", 100, 200),
        _x("python_function", ROOT + "deepspeed/runtime/bf16_optimizer.py(523): _update_hp_grad", 140, 10),
        _x("cpu_op", "aten::add_", 141, 8),
        _x("cuda_runtime", "cudaLaunchKernel", 142, 2, correlation=2),
        _x("python_function", ROOT + "deepspeed/runtime/bf16_optimizer.py(523): _update_hp_grad", 280, 10),
        _x("python_function", "<built-in method add_ of Tensor object at 0x1>", 281, 8),
        _x("cuda_runtime", "cudaLaunchKernel", 282, 2, correlation=3),
        _x("kernel", "gemm", 10, 80, tid=7, correlation=1),
        _x("kernel", "add_kernel", 150, 10, tid=7, correlation=2),
        _x("kernel", "add_kernel", 290, 40, tid=7, correlation=3),
    ]


def test_gaps_are_summed_and_traced_to_the_innermost_frame_of_our_code():
    report = analyse(_trace(), min_us=5)
    assert report["window_ms"] == pytest.approx(0.320)
    assert report["busy_ms"] == pytest.approx(0.130)
    assert report["idle_ms"] == pytest.approx(0.190) == pytest.approx(report["idle_in_gaps_ms"])
    assert report["gaps"] == 2 and report["steps"] == 1
    (site,) = report["sites"]
    assert site["site"] == "deepspeed/runtime/bf16_optimizer.py:523 _update_hp_grad"
    assert site["gaps"] == 2 and site["idle_us"] == pytest.approx(190) and site["largest_us"] == pytest.approx(130)
    assert site["next_kernel"] == "add_kernel"
    # the enclosing frames, outermost first, reach back to the step that began long before
    assert site["stack"][0] == "hybridlm/engine/engine.py:340 train_step"
    assert site["stack"][1:] == ["deepspeed/runtime/bf16_optimizer.py:532 update_hp_grads",
                                 "deepspeed/runtime/bf16_optimizer.py:523 _update_hp_grad"]


def test_small_gaps_are_left_out_and_overlapping_kernels_merge():
    assert merged_busy([(0, 10), (5, 20), (30, 40)]) == [(0, 20), (30, 40)]
    report = analyse(_trace(), min_us=100)
    assert report["gaps"] == 1 and report["idle_in_gaps_ms"] == pytest.approx(0.130)
    assert report["idle_ms"] == pytest.approx(0.190)  # the idle total still counts every gap


def test_a_gap_whose_launch_has_no_python_frame_is_named_by_its_host_op():
    events = [_x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 0, 50, tid=2),
              _x("cuda_runtime", "cudaLaunchKernel", 40, 2, tid=2, correlation=9),
              _x("kernel", "a", 0, 10, tid=7, correlation=8), _x("kernel", "b", 45, 10, tid=7, correlation=9)]
    (site,) = analyse(events, min_us=5)["sites"]
    assert site["site"] == "autograd::engine::evaluate_function: MmBackward0" and site["idle_us"] == 35


def test_short_frame_and_errors(tmp_path, capsys):
    assert short_frame(ROOT + "fla/ops/utils.py(12): f", ("fla/",)) == "fla/ops/utils.py:12 f"
    assert short_frame("<built-in method x>", ("fla/",)) == "<built-in method x>"
    with pytest.raises(ValueError, match="no GPU kernels"):
        analyse([_x("cpu_op", "aten::mm", 0, 1)])
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert len(load_events(path)) == len(_trace())
    main([str(path), "--json", str(tmp_path / "r.json")])
    assert "_update_hp_grad" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["gaps"] == 2
    with pytest.raises(SystemExit, match="no such file"):
        main([str(tmp_path / "missing.json")])
    (tmp_path / "other.json").write_text(json.dumps({"loss": 1.0}))
    with pytest.raises(SystemExit, match="expected a Chrome trace"):
        main([str(tmp_path / "other.json")])
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [{"ph"'))
    with pytest.raises(SystemExit, match="not a readable JSON trace"):
        main([str(tmp_path / "cut.json.gz")])
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": [_x("cpu_op", "aten::mm", 0, 1)]}))
    with pytest.raises(SystemExit, match="no GPU kernels"):
        main([str(tmp_path / "cpu.json")])


def test_the_other_views_of_a_trace():
    from benchmarks.harness.trace_gaps import (Trace, frame_times, gaps_by_step, host_frames_at_gaps, host_waits,
                                           kernel_sources)
    events = _trace() + [_x("cuda_runtime", "cudaStreamSynchronize", 300, 35, correlation=99)]
    tr = Trace(events)
    # what the main thread ran at each gap's middle (120 and 225): the optimizer's loop, under the step
    (row,) = host_frames_at_gaps(tr, min_us=5, depth=2)
    assert row == {"frames": "train_step > update_hp_grads", "gaps": 2, "idle_ms": pytest.approx(0.190)}
    # the kernels named add_kernel, by grid and launching code
    (k,) = kernel_sources(tr, "add_kernel")
    assert k["kernels"] == 2 and k["ms"] == pytest.approx(0.050) and k["launched_by"].startswith(
        "deepspeed/runtime/bf16_optimizer.py:523 _update_hp_grad < deepspeed/runtime/bf16_optimizer.py:532")
    (w,) = host_waits(tr)
    assert w["calls"] == 1 and w["ms"] == pytest.approx(0.035) and w["call"].startswith("cudaStreamSynchronize | ")
    (st,) = gaps_by_step(tr, first_ms=0.1)
    assert st["gaps"] == 2 and st["early_gaps"] == 1 and st["early_idle_ms"] == pytest.approx(0.060)
    (f,) = frame_times(tr, events, "update_hp_grads")
    assert f["main_thread"] and f["step"] == "ProfilerStep#7" and f["at_ms"] == pytest.approx(0.1) and f["ms"] == 0.2


def test_the_cli_prints_every_view(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    main([str(path), "--host-frames", "2", "--kernels", "add_kernel", "--host-waits", "--step-start", "60",
          "--frame-times", "_update_hp_grad", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    for heading in ("idle by the host's frames", "kernels holding 'add_kernel'", "synchronising calls",
                    "ProfilerStep#7:", "frames holding '_update_hp_grad'"):
        assert heading in out, heading
    saved = json.loads((tmp_path / "r.json").read_text())
    assert {"host_frames", "kernels", "host_waits", "steps_detail", "frame_times"} <= set(saved)
