"""Where a training step's time goes: torch.profiler over a few steps, kernels grouped into categories.

Used by ``python -m pretrain.train_speed --profile N``: after the timed steps, N more steps run under
the profiler (its overhead stays out of the timing); each entry of ``train_speed.json`` then has a
``profile`` with the device time per category and the top kernels. Categories are matched on kernel names,
first match wins.
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
                            record_shapes=False, with_stack=trace_path is not None)
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
        }


def format_profile(summary: Dict[str, Any], limit: Optional[int] = 10) -> str:
    lines = [f"  {summary['clock']}: {summary['ms_per_step']:.2f} ms per step, "
             f"{summary.get('calls_per_step', 0):.0f} calls per step"]
    for c in summary["categories"]:
        lines.append(f"    {100 * c['share']:5.1f}%  {c['ms_per_step']:8.2f} ms  {c['category']}")
    for r in summary["top"][:limit]:
        lines.append(f"      {100 * r['share']:5.1f}%  {r['name'][:90]}")
    return "\n".join(lines)
