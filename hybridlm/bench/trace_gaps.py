"""Where the GPU waits: the idle gaps of a profiled training step, each traced to the code that ran then.

A step's time is its kernels' time plus the time the GPU has nothing to run (the host is launching, syncing,
or running Python between launches). :mod:`hybridlm.bench.profile_step` sums the first; this module reads a
Chrome trace written with Python stacks (``python -m pretrain.train_speed --profile N --trace``) and finds the
second. Each gap ends with a kernel; the host call that launched it (matched by the trace's correlation id) lies
inside a stack of Python frames, and the innermost frame of the code we can change (``--frames``: this
project, DeepSpeed, fla, torch.optim by default) names the gap's site. Sites are summed over the profiled steps.

    python -m hybridlm.bench.trace_gaps trace_gdn_300m.json.gz [--min-us 5] [--top 25]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEFAULT_FRAMES = ("hybridlm/", "pretrain/", "deepspeed/", "fla/", "torch/optim/", "torch/autograd/")
_FRAME = re.compile(r"^(?P<path>.*?\.py)\((?P<line>\d+)\): (?P<func>.*)$")


def load_events(path: Path) -> List[Dict[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"trace: {path}: not a readable JSON trace ({e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"trace: {path}: expected a Chrome trace (a 'traceEvents' list), got {type(data).__name__}")
    return events


def short_frame(name: str, frames: Sequence[str]) -> str:
    """``/abs/.../deepspeed/runtime/bf16_optimizer.py(523): _update_hp_grad`` -> the path from the first of
    ``frames`` found in it: ``deepspeed/runtime/bf16_optimizer.py:523 _update_hp_grad``."""
    m = _FRAME.match(name)
    if not m:
        return name
    path = m["path"]
    for root in frames:
        i = path.rfind(root)
        if i >= 0:
            path = path[i:]
            break
    return f"{path}:{m['line']} {m['func']}"


def merged_busy(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The union of ``(start, end)`` intervals, sorted and merged."""
    out: List[List[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class _Enclosing:
    """The events of one thread that enclose a time, outermost first. Events on a thread nest, so each has a
    parent (the innermost event open when it starts); the enclosing chain of a time is the last event to start
    before it and those of its ancestors still open then."""

    def __init__(self, events: List[Dict[str, Any]]):
        self.events = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
        self.starts = [e["ts"] for e in self.events]
        self.parent: List[int] = []
        open_: List[int] = []
        for i, e in enumerate(self.events):
            while open_ and _end(self.events[open_[-1]]) < e["ts"]:
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(i)

    def at(self, t: float) -> List[Dict[str, Any]]:
        i = bisect.bisect_right(self.starts, t) - 1
        chain = []
        while i >= 0:
            if _end(self.events[i]) >= t:
                chain.append(self.events[i])
            i = self.parent[i]
        return chain[::-1]


def _end(e: Dict[str, Any]) -> float:
    return e["ts"] + e.get("dur", 0)


def analyse(events: List[Dict[str, Any]], min_us: float = 5.0,
            frames: Sequence[str] = DEFAULT_FRAMES) -> Dict[str, Any]:
    """Idle gaps of the GPU between the first and the last kernel of the trace, grouped by site."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise ValueError("trace: no GPU kernels in it (was it recorded on a GPU with CUDA activity?)")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    by_thread: Dict[Tuple[Any, Any], List[Dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    enclosing = {k: _Enclosing(v) for k, v in by_thread.items()}
    steps = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep")]

    gpu.sort(key=lambda e: e["ts"])
    busy = merged_busy((e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu)
    starts = [e["ts"] for e in gpu]
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    sites: Dict[str, Dict[str, Any]] = {}
    gaps = 0
    for (_, end), (nxt, _) in zip(busy, busy[1:]):
        gap = nxt - end
        if gap < min_us:
            continue
        gaps += 1
        kernel = gpu[bisect.bisect_left(starts, nxt)]
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        stack: List[str] = []
        op = ""
        if launch is not None:
            for e in enclosing.get((launch.get("pid"), launch.get("tid")), _Enclosing([])).at(launch["ts"]):
                if e["cat"] == "python_function":
                    stack.append(short_frame(e["name"], frames))
                else:
                    op = e["name"]
        ours = [f for f in stack if any(f.startswith(r) for r in frames)]
        site = ours[-1] if ours else (op or "(no host stack: autograd engine thread or none recorded)")
        s = sites.setdefault(site, {"site": site, "idle_us": 0.0, "gaps": 0, "largest_us": 0.0})
        s["idle_us"] += gap
        s["gaps"] += 1
        if gap > s["largest_us"]:
            s["largest_us"], s["next_kernel"], s["host_op"], s["stack"] = gap, kernel["name"][:120], op, ours[-8:]
    n_steps = max(len(steps), 1)
    ranked = sorted(sites.values(), key=lambda s: -s["idle_us"])
    return {
        "steps": len(steps), "window_ms": window / 1e3, "busy_ms": busy_us / 1e3,
        "idle_ms": (window - busy_us) / 1e3, "idle_in_gaps_ms": sum(s["idle_us"] for s in ranked) / 1e3,
        "min_gap_us": min_us, "gaps": gaps,
        "per_step": {"window_ms": window / 1e3 / n_steps, "idle_ms": (window - busy_us) / 1e3 / n_steps},
        "sites": ranked,
    }


def format_report(report: Dict[str, Any], top: int = 25) -> str:
    lines = [f"{report['steps']} steps: {report['window_ms']:.1f} ms from the first kernel to the last, "
             f"GPU busy {report['busy_ms']:.1f} ms, idle {report['idle_ms']:.1f} ms "
             f"({report['per_step']['idle_ms']:.2f} ms a step); {report['gaps']} gaps >= {report['min_gap_us']:g} us "
             f"hold {report['idle_in_gaps_ms']:.1f} ms"]
    for s in report["sites"][:top]:
        lines.append(f"  {s['idle_us'] / 1e3:8.2f} ms {s['gaps']:6d} gaps (largest {s['largest_us']:7.0f} us)  {s['site']}")
        lines.append(f"      next kernel {s.get('next_kernel', '')[:80]} | host op {s.get('host_op', '')[:50]}")
        for f in s.get("stack", [])[-4:-1]:
            lines.append(f"      under {f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz) recorded with Python stacks")
    p.add_argument("--min-us", type=float, default=5.0, help="smallest gap counted (microseconds)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--frames", nargs="+", default=list(DEFAULT_FRAMES),
                   help="path fragments of the code a gap may be traced to (innermost match names the site)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        raise SystemExit(f"trace_gaps: {args.trace}: no such file")
    try:
        report = analyse(load_events(args.trace), args.min_us, args.frames)
    except ValueError as e:
        raise SystemExit(f"trace_gaps: {e}") from None
    print(format_report(report, args.top))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
