"""Where the GPU waits: the idle gaps of a profiled training step, each traced to the code that ran then.

A step's time is its kernels' time plus the time the GPU has nothing to run (the host is launching, syncing,
or running Python between launches). :mod:`benchmarks.harness.profile_step` sums the first; this module reads a
Chrome trace written with Python stacks (``python -m benchmarks.train_speed --profile N --trace``) and finds the
second. Each gap ends with a kernel; the host call that launched it (matched by the trace's correlation id) lies
inside a stack of Python frames, and the innermost frame of the code we can change (``--frames``: this
project, DeepSpeed, fla, torch.optim by default) names the gap's site. Sites are summed over the profiled steps.

    python -m benchmarks.harness.trace_gaps trace_gdn_300m.json.gz [--min-us 5] [--top 25]

Other views of the same trace: ``--host-frames DEPTH`` (idle time by what the main thread ran at each gap's
middle), ``--kernels SUBSTRING`` (those kernels by grid and launching code), ``--host-waits`` (the host's
synchronising calls), ``--step-start MS`` (each step's gaps, and those in its first MS), ``--frame-times
SUBSTRING`` (when those Python frames ran, and on which thread).
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


class Trace:
    """A trace's events indexed once: the GPU's busy intervals, launches by correlation id, and each host
    thread's nesting of Python frames and ops."""

    def __init__(self, events: List[Dict[str, Any]], frames: Sequence[str] = DEFAULT_FRAMES):
        self.frames = tuple(frames)
        self.gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                          key=lambda e: e["ts"])
        if not self.gpu:
            raise ValueError("trace: no GPU kernels in it (was it recorded on a GPU with CUDA activity?)")
        self.starts = [e["ts"] for e in self.gpu]
        self.busy = merged_busy((e["ts"], _end(e)) for e in self.gpu)
        self.launch_events = [e for e in events if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES]
        self.launches = {e["args"]["correlation"]: e for e in self.launch_events if "correlation" in e.get("args", {})}
        by_thread: Dict[Tuple[Any, Any], List[Dict[str, Any]]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op"):
                by_thread[(e.get("pid"), e.get("tid"))].append(e)
        self.enclosing = {k: _Enclosing(v) for k, v in by_thread.items()}
        # the main thread: the one with the most Python frames
        py = {k: sum(e["cat"] == "python_function" for e in v) for k, v in by_thread.items()}
        self.main = max(py, key=py.get) if py else None
        self.steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                             and str(e.get("name", "")).startswith("ProfilerStep")), key=lambda e: e["ts"])

    def gaps(self, min_us: float):
        """``(start, end)`` of every idle gap of at least ``min_us``."""
        return [(end, nxt) for (_, end), (nxt, _) in zip(self.busy, self.busy[1:]) if nxt - end >= min_us]

    def host_stack(self, thread, t: float) -> Tuple[List[str], str]:
        """The short names of the Python frames of ``thread`` open at ``t`` (outermost first) and its innermost op."""
        stack, op = [], ""
        for e in self.enclosing.get(thread, _Enclosing([])).at(t):
            if e["cat"] == "python_function":
                stack.append(short_frame(e["name"], self.frames))
            else:
                op = e["name"]
        return stack, op

    def ours(self, stack: List[str]) -> List[str]:
        return [f for f in stack if any(f.startswith(r) for r in self.frames)]

    def launch_stack(self, kernel: Dict[str, Any]) -> Tuple[List[str], str]:
        launch = self.launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return [], ""
        return self.host_stack((launch.get("pid"), launch.get("tid")), launch["ts"])


def analyse(events: List[Dict[str, Any]], min_us: float = 5.0,
            frames: Sequence[str] = DEFAULT_FRAMES) -> Dict[str, Any]:
    """Idle gaps of the GPU between the first and the last kernel of the trace, grouped by site."""
    tr = events if isinstance(events, Trace) else Trace(events, frames)
    window = tr.busy[-1][1] - tr.busy[0][0]
    busy_us = sum(e - s for s, e in tr.busy)
    sites: Dict[str, Dict[str, Any]] = {}
    gaps = tr.gaps(min_us)
    for end, nxt in gaps:
        gap = nxt - end
        kernel = tr.gpu[bisect.bisect_left(tr.starts, nxt)]
        stack, op = tr.launch_stack(kernel)
        ours = tr.ours(stack)
        site = ours[-1] if ours else (op or "(no host stack: autograd engine thread or none recorded)")
        s = sites.setdefault(site, {"site": site, "idle_us": 0.0, "gaps": 0, "largest_us": 0.0})
        s["idle_us"] += gap
        s["gaps"] += 1
        if gap > s["largest_us"]:
            s["largest_us"], s["next_kernel"], s["host_op"], s["stack"] = gap, kernel["name"][:120], op, ours[-8:]
    n_steps = max(len(tr.steps), 1)
    ranked = sorted(sites.values(), key=lambda s: -s["idle_us"])
    return {
        "steps": len(tr.steps), "window_ms": window / 1e3, "busy_ms": busy_us / 1e3,
        "idle_ms": (window - busy_us) / 1e3, "idle_in_gaps_ms": sum(s["idle_us"] for s in ranked) / 1e3,
        "min_gap_us": min_us, "gaps": len(gaps),
        "per_step": {"window_ms": window / 1e3 / n_steps, "idle_ms": (window - busy_us) / 1e3 / n_steps},
        "sites": ranked,
    }


def host_frames_at_gaps(tr: Trace, min_us: float = 2.0, below: str = "train_step", depth: int = 5) -> List[Dict]:
    """Idle time by what the main thread was running at each gap's middle: its frames of our code from the one
    named ``below`` (or from the outermost), ``depth`` of them, joined."""
    out: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    for end, nxt in tr.gaps(min_us):
        names = [f.split(" ")[-1] for f in tr.ours(tr.host_stack(tr.main, (end + nxt) / 2)[0])]
        i = names.index(below) if below in names else 0
        a = out[" > ".join(names[i:i + depth]) or "(no frame)"]
        a[0] += 1
        a[1] += nxt - end
    return [{"frames": k, "gaps": n, "idle_ms": us / 1e3} for k, (n, us) in sorted(out.items(), key=lambda kv: -kv[1][1])]


def kernel_sources(tr: Trace, substring: str) -> List[Dict]:
    """The kernels whose name holds ``substring``, by grid and the code that launched them."""
    out: Dict[Tuple, List[float]] = defaultdict(lambda: [0, 0.0])
    for k in tr.gpu:
        if substring not in k["name"]:
            continue
        stack, op = tr.launch_stack(k)
        key = (str(k.get("args", {}).get("grid")), " < ".join(tr.ours(stack)[::-1][:3]) or op)
        out[key][0] += 1
        out[key][1] += k.get("dur", 0)
    return [{"grid": g, "launched_by": by, "kernels": n, "ms": us / 1e3}
            for (g, by), (n, us) in sorted(out.items(), key=lambda kv: -kv[1][1])]


def host_waits(tr: Trace) -> List[Dict]:
    """The host's synchronising calls (stream / device / event synchronize), by the code that made them."""
    out: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    for e in tr.launch_events:
        if "Synchronize" in e["name"]:
            stack, _ = tr.host_stack((e.get("pid"), e.get("tid")), e["ts"])
            a = out[e["name"] + " | " + (" < ".join(tr.ours(stack)[::-1][:3]) or "-")]
            a[0] += 1
            a[1] += e.get("dur", 0)
    return [{"call": k, "calls": n, "ms": us / 1e3} for k, (n, us) in sorted(out.items(), key=lambda kv: -kv[1][1])]


def frame_times(tr: Trace, events: List[Dict[str, Any]], substring: str) -> List[Dict]:
    """Every Python frame whose name holds ``substring``: its thread, when it started (ms from the start of the
    profiled step it began in) and how long it ran."""
    rows = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "python_function" or substring not in e.get("name", ""):
            continue
        step = next((st for st in reversed(tr.steps) if st["ts"] <= e["ts"]), None)
        rows.append({"frame": short_frame(e["name"], tr.frames), "main_thread": (e.get("pid"), e.get("tid")) == tr.main,
                     "step": step["name"] if step else None,
                     "at_ms": (e["ts"] - step["ts"]) / 1e3 if step else None, "ms": e.get("dur", 0) / 1e3})
    return sorted(rows, key=lambda r: (r["step"] or "", r["at_ms"] or 0))


def gaps_by_step(tr: Trace, first_ms: float = 60.0, min_us: float = 20.0) -> List[Dict]:
    """Per profiled step: its idle gaps, and those that start within its first ``first_ms``."""
    rows = []
    for s in tr.steps:
        t0, t1 = s["ts"], _end(s)
        gaps = [(end - t0, nxt - end) for end, nxt in tr.gaps(min_us) if t0 <= end < t1]
        early = [g for o, g in gaps if o < first_ms * 1e3]
        rows.append({"step": s["name"], "ms": s.get("dur", 0) / 1e3, "gaps": len(gaps),
                     "idle_ms": sum(g for _, g in gaps) / 1e3, "early_gaps": len(early), "early_idle_ms": sum(early) / 1e3,
                     "over_300us_at_ms": [round(o / 1e3, 1) for o, g in gaps if g > 300]})
    return rows


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
    p.add_argument("--host-frames", type=int, default=0, metavar="DEPTH",
                   help="also: idle time by the main thread's frames at each gap's middle (DEPTH frames from "
                        "train_step)")
    p.add_argument("--kernels", nargs="+", default=[], metavar="SUBSTRING",
                   help="also: the kernels whose name holds SUBSTRING, by grid and launching code")
    p.add_argument("--host-waits", action="store_true", help="also: the host's synchronising calls by code")
    p.add_argument("--step-start", type=float, default=0.0, metavar="MS",
                   help="also: per step, the idle gaps (>= 20 us) and those in its first MS milliseconds")
    p.add_argument("--frame-times", nargs="+", default=[], metavar="SUBSTRING",
                   help="also: when each Python frame whose name holds SUBSTRING ran, and on which thread")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        raise SystemExit(f"trace_gaps: {args.trace}: no such file")
    try:
        events = load_events(args.trace)
        tr = Trace(events, args.frames)
    except ValueError as e:
        raise SystemExit(f"trace_gaps: {e}") from None
    report = analyse(tr, args.min_us)
    print(format_report(report, args.top))
    if args.host_frames:
        report["host_frames"] = host_frames_at_gaps(tr, depth=args.host_frames)
        print("idle by the host's frames at each gap's middle:")
        for r in report["host_frames"][:args.top]:
            print(f"  {r['idle_ms']:8.2f} ms {r['gaps']:5d} gaps  {r['frames']}")
    for sub in args.kernels:
        report.setdefault("kernels", {})[sub] = rows = kernel_sources(tr, sub)
        print(f"kernels holding {sub!r}:")
        for r in rows[:args.top]:
            print(f"  {r['ms']:8.2f} ms {r['kernels']:5d}x grid {r['grid']}  {r['launched_by'][:160]}")
    if args.host_waits:
        report["host_waits"] = host_waits(tr)
        print("the host's synchronising calls:")
        for r in report["host_waits"][:args.top]:
            print(f"  {r['ms']:8.2f} ms {r['calls']:4d}x  {r['call'][:160]}")
    for sub in args.frame_times:
        report.setdefault("frame_times", {})[sub] = rows = frame_times(tr, events, sub)
        print(f"frames holding {sub!r}:")
        for r in rows[:args.top]:
            where = "main" if r["main_thread"] else "other"
            at = "-" if r["at_ms"] is None else f"{r['at_ms']:.1f}"
            print(f"  {r['step']} at {at} ms, {r['ms']:.2f} ms, {where} thread  {r['frame']}")
    if args.step_start:
        report["steps_detail"] = gaps_by_step(tr, args.step_start)
        for r in report["steps_detail"]:
            print(f"{r['step']}: {r['ms']:.1f} ms, {r['gaps']} gaps >= 20 us holding {r['idle_ms']:.1f} ms; in its "
                  f"first {args.step_start:g} ms {r['early_gaps']} holding {r['early_idle_ms']:.1f} ms; gaps over "
                  f"0.3 ms at {r['over_300us_at_ms']} ms")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
