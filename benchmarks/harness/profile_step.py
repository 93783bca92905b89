"""Where a training step's time goes: torch.profiler over a few steps, kernels grouped into categories.

Used by ``python -m benchmarks.train_speed --profile N``: after the timed steps, N more steps run under
the profiler (its overhead stays out of the timing); each entry of ``train_speed.json`` then has a
``profile`` with the device time per category and the top kernels. Categories are matched on kernel names,
first match wins.

GEMMs are most of a step (~70 % of GDN-300M's on an H200), and a kernel's name does not say which matrix it
multiplied. The profile's ``gemms`` table groups the time of the aten GEMM ops (the ones that launch the kernels:
``mm``, ``addmm``, ``bmm``, ...) by their operands' shapes, with the FLOPs those shapes imply and the rate they ran
at: which projection, which LM-head chunk, which gradient runs below the GEMM rate the others reach.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

CATEGORIES = [  # (category, regex on the kernel / op name), first match wins
    ("nccl / communication", r"nccl|all_reduce|allreduce|reduce_scatter|all_gather|broadcast|gloo"),
    ("optimizer", r"adam|multi_tensor|_foreach|fused_adam|clip_grad|norm_ungrouped"),
    ("cross-entropy / LM head loss", r"cross_entropy|fused_linear|flce|log_softmax|logsumexp|nll_loss"),
    ("softmax attention (MLA / SDPA)", r"flash|fmha|attention|sdpa|efficient_attention|cudnn_attn"),
    ("linear recurrence (fla chunk / recurrent)",
     r"chunk|fused_recurrent|gated_delta|delta_rule|kda|simple_gla|gla_|wy_repr|solve_tril|recompute_w_u"),
    ("short conv", r"conv1d|causal_conv|conv_"),
    ("norms (RMSNorm, gated norm, l2norm)", r"rms|layer_norm|layernorm|l2norm|l2_norm|norm_fwd|norm_bwd"),
    ("matmul (GEMM)", r"gemm|cutlass|cublas|sm90_xmma|matmul|_mm_|addmm|\bmm\b|bmm|wgmma|nvjet"),
    ("activations / elementwise", r"swiglu|silu|sigmoid|elementwise|vectorized|unrolled|mul_|add_|copy|fill|cast"),
]


def categorize(name: str) -> str:
    lowered = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


# aten ops that launch a GEMM themselves (not ``linear`` / ``matmul``, which call them: counting both would count
# their kernels twice), and which operands are the two matrices (``addmm``'s first is the added term)
GEMM_OPERANDS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::_scaled_mm": (0, 1), "aten::addmm": (1, 2),
                 "aten::addmm_": (1, 2), "aten::baddbmm": (1, 2), "aten::baddbmm_": (1, 2), "aten::addbmm": (1, 2)}


def gemm_flops(op: str, shapes) -> Optional[float]:
    """FLOPs of one call of the GEMM op ``op`` with input ``shapes`` (the profiler's ``input_shapes``): ``2 * M *
    K * N`` (times the batch), or None when ``op`` is no GEMM op or the shapes are not a product of matrices."""
    which = GEMM_OPERANDS.get(op)
    if which is None or len(shapes) <= max(which):
        return None
    a, b = shapes[which[0]], shapes[which[1]]
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    m = 1
    for n in a[:-1]:
        m *= n
    return 2.0 * m * a[-1] * b[-1]


def gemm_table(events, steps: int, cuda: bool, top: int = 15) -> List[Dict[str, Any]]:
    """The GEMM ops of ``events`` (the profiler's ``events()``, one per call) by op and shapes: calls and
    milliseconds per step, FLOPs per call and the TFLOP/s they ran at, largest time first. On a GPU a call's time is
    that of the GEMM kernels it launched itself: an op's ``device_time_total`` also held time that was not its
    GEMMs' (~2.5-3 ms a call for the LM head's at the 300M shapes on an H200; BENCHMARKS.md, "Training step
    breakdown"). On a CPU, its CPU time."""
    groups: Dict[Any, List[float]] = {}
    for evt in events:
        shapes = getattr(evt, "input_shapes", None) or []
        flops = gemm_flops(evt.name, shapes)
        if flops is None:
            continue
        if cuda:
            us = sum(k.duration for k in evt.kernels if categorize(k.name) == "matmul (GEMM)")
        else:
            us = evt.cpu_time_total
        if us <= 0:
            continue
        key = (evt.name, tuple(tuple(s) for s in shapes if s))
        calls_us_flops = groups.setdefault(key, [0, 0.0, flops])
        calls_us_flops[0] += 1
        calls_us_flops[1] += us
    rows = [{"op": op, "shapes": [list(s) for s in shapes], "calls_per_step": calls / steps,
             "ms_per_step": us / 1e3 / steps, "gflop_per_call": flops / 1e9,
             "tflops": flops * calls / (us * 1e-6) / 1e12}
            for (op, shapes), (calls, us, flops) in groups.items()]
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:top]


def is_kernel_row(name: str, device_type, is_user_annotation: bool = False) -> bool:
    """Whether a profiler row is a GPU kernel. The profiler also puts its ``ProfilerStep#N`` ranges (and any
    ``record_function`` range) on the GPU timeline: such a row spans the whole step and is no kernel."""
    if device_type != torch.autograd.DeviceType.CUDA or is_user_annotation:
        return False
    return not name.startswith("ProfilerStep")


class StepProfiler:
    """An ``on_step``-style hook: profiles steps ``skip + 1 .. skip + active`` (1-based) of a run. ``sync=True``
    waits for the device at each step's end, so that each window holds its own step's kernels; a loop that calls
    the hook after launching the next step (reading results one step late) passes ``False``: its windows then
    hold the launches of one step each, and a sync would take away the overlap being measured."""

    def __init__(self, skip: int, active: int, device: torch.device, trace_path: Optional[Path] = None,
                 sync: bool = True):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.device, self.active, self.trace_path, self.sync = device, active, trace_path, sync
        # a trace keeps the Python stacks, so that each wait of the GPU can be traced to the code that ran then
        self.prof = profile(activities=activities, schedule=schedule(wait=skip, warmup=0, active=active, repeat=1),
                            record_shapes=True, with_stack=trace_path is not None)
        self.prof.__enter__()
        self.steps = 0
        self.closed = False

    def __call__(self, _result=None) -> None:
        if self.closed:
            return
        if self.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.step()
        self.steps += 1

    def close(self) -> None:
        if not self.closed:
            self.prof.__exit__(None, None, None)
            self.closed = True
            if self.trace_path is not None and self.steps > 0:
                Path(self.trace_path).parent.mkdir(parents=True, exist_ok=True)
                self.prof.export_chrome_trace(str(self.trace_path))  # gzipped for a .gz name

    def summary(self, top: int = 25) -> Dict[str, Any]:
        """Device time per category (CUDA kernels on a GPU, CPU ops on a CPU) per profiled step, and the top
        entries by self time."""
        self.close()
        cuda = self.device.type == "cuda"
        rows: List[Dict[str, Any]] = []
        for evt in self.prof.key_averages():
            if cuda:
                # kernels only: a CPU op (aten::mm, an autograd Function, the ProfilerStep annotation) also carries
                # the device time of the kernels it launched, which would count those kernels twice or more
                if not is_kernel_row(evt.key, evt.device_type, getattr(evt, "is_user_annotation", False)):
                    continue
                us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
            else:
                us = evt.self_cpu_time_total
            if us and us > 0:
                rows.append({"name": evt.key, "self_us": float(us), "calls": int(evt.count)})
        rows.sort(key=lambda r: -r["self_us"])
        gemms = gemm_table(self.prof.events(), max(self.active, 1), cuda)
        total = sum(r["self_us"] for r in rows) or 1.0
        per_cat: Dict[str, float] = {}
        for r in rows:
            r["category"] = categorize(r["name"])
            per_cat[r["category"]] = per_cat.get(r["category"], 0.0) + r["self_us"]
        steps = max(self.active, 1)
        return {
            "clock": "CUDA kernel self time" if cuda else "CPU op self time",
            "profiled_steps": steps,
            "ms_per_step": total / 1e3 / steps,
            "calls_per_step": sum(r["calls"] for r in rows) / steps,  # kernel launches on a GPU, ops on a CPU
            "categories": [{"category": c, "ms_per_step": us / 1e3 / steps, "share": us / total}
                           for c, us in sorted(per_cat.items(), key=lambda kv: -kv[1])],
            "top": [{**r, "ms_per_step": r["self_us"] / 1e3 / steps, "share": r["self_us"] / total}
                    for r in rows[:top]],
            "gemms": gemms,
        }


def format_profile(summary: Dict[str, Any], limit: Optional[int] = 10) -> str:
    lines = [f"  {summary['clock']}: {summary['ms_per_step']:.2f} ms per step, "
             f"{summary.get('calls_per_step', 0):.0f} calls per step"]
    for c in summary["categories"]:
        lines.append(f"    {100 * c['share']:5.1f}%  {c['ms_per_step']:8.2f} ms  {c['category']}")
    for r in summary["top"][:limit]:
        lines.append(f"      {100 * r['share']:5.1f}%  {r['name'][:90]}")
    if summary.get("gemms"):
        lines.append("    GEMMs by shape: ms per step, calls per step, TFLOP/s")
    for g in summary.get("gemms", [])[:limit]:
        shapes = " x ".join("[" + ", ".join(str(n) for n in s) + "]" for s in g["shapes"])
        lines.append(f"      {g['ms_per_step']:8.2f} ms {g['calls_per_step']:5.1f}  {g['tflops']:7.1f}  "
                     f"{g['op']} {shapes}")
    return "\n".join(lines)
