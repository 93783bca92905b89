"""Where the `gpu` tests run: on a CUDA device, or on a CPU through Triton's interpreter.

With CUDA every `gpu` test runs at the shapes of the shipped configs. Without CUDA and with ``TRITON_INTERPRET=1``
(CI's slow phase: ``TRITON_INTERPRET=1 python -m pytest -o addopts= -m gpu tests``) the same tests run the same
Triton kernels, ours and fla's, through the interpreter (tests/support/triton_interpreter.py) on CPU tensors, at the
shapes :func:`scaled` picks for two cores, with the models' backend forced to ``triton`` (:func:`place`). The tests
the interpreter cannot run are listed in :data:`CUDA_ONLY` and :data:`CUDA_ONLY_PATTERNS`, each with the reason;
nothing else is skipped there.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import torch

CUDA = torch.cuda.is_available()
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"

# test node ids (a file, a test, or a test with its parameters) -> why the interpreter cannot run them
CUDA_ONLY = {
    "tests/gpu/test_readback_gpu.py":
        "CUDA streams and events: what is measured is when the device finishes work, which a CPU has no notion of",
    "tests/gpu/test_device_step_gpu.py":
        "CUDA's fused AdamW and its found_inf skip; the same engine tests run on the CPU in tests/test_engine.py",
    "tests/gpu/test_mamba2_compile_gpu.py":
        "torch.compile emits C++ for CPU tensors, not the Triton kernels the GPU runs",
    "tests/gpu/test_generation_gpu.py::test_cuda_graph_decode_equals_eager_static_cache": "captures a CUDA graph",
    "tests/gpu/test_generation_gpu.py::test_captured_step_with_a_kernel_switch_decodes_like_without_it":
        "the switches act inside a captured CUDA graph only",
    "tests/gpu/test_generation_gpu.py::test_graphed_generate_equals_its_eager_run": "captures a CUDA graph",
    "tests/gpu/test_generation_gpu.py::test_generate_on_cuda_takes_the_graph_path_with_the_same_tokens":
        "generate()'s fast path captures a CUDA graph; on a CPU its eager steps are tests/test_generate_fast_path.py",
    "tests/gpu/test_mamba2_step_gpu.py::test_a_layer_step_is_two_gemms_and_the_fused_kernel":
        "counts the CUDA kernels a step launches (torch.profiler's CUDA activity)",
    "tests/gpu/test_mamba2_step_gpu.py::test_graphed_decode_with_and_without_the_fused_step": "captures a CUDA graph",
    "tests/gpu/test_latent_decode_gpu.py::test_graphed_decode_through_the_kernel_and_through_sdpa":
        "captures a CUDA graph",
}


# fla's chunk kernels (GDN, KDA, Mamba2's SSD) in bf16: the interpreter keeps a bf16 value as its uint16 bits and runs
# numpy on those bits, so bf16 adds, products, dots and sums that a kernel does without casting to fp32 come out wrong
# (errors of order 1 where a GPU's stay near 1e-2), and it has no bf16 constant (``InterpreterBuilder.get_bf16``:
# Mamba2's kernels stop). The project's kernels compute in fp32 and run in bf16 there; these tests run in fp32 there.
FLA_BF16 = "fla's chunk kernels in bf16: the interpreter computes bf16 arithmetic on the raw bits (fp32 runs them)"
CUDA_ONLY_PATTERNS = (
    (r"tests/gpu/test_triton_paths\.py::test_sublayer_triton_matches_torch\[.*(gdn|gdn_biases|kda|mamba2)-bfloat16\]", FLA_BF16),
    (r"tests/gpu/test_triton_paths\.py::test_whole_model_loss_and_grads_match\[bfloat16\]", FLA_BF16),
    (r"tests/gpu/test_fused_training_gpu\.py::test_fused_training_step_matches_the_unfused_one\[(gdn|kda|mamba2).*\]",
     FLA_BF16 + "; this test trains in bf16"),
    (r"tests/gpu/test_generation_gpu\.py::test_cached_decode_matches_full_forward\[mixed-bfloat16\]",
     FLA_BF16),
)


def skip_reason(nodeid: str) -> Optional[str]:
    """Why the `gpu` test ``nodeid`` cannot run in this process, or None."""
    if CUDA:
        return None
    if not INTERPRETED:
        return ("needs CUDA, or Triton's interpreter: TRITON_INTERPRET=1 python -m pytest -o addopts= -m gpu tests "
                "(tests/support/gpu_path.py)")
    for prefix, reason in CUDA_ONLY.items():
        if nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "["):
            return f"CUDA only: {reason}"
    for pattern, reason in CUDA_ONLY_PATTERNS:
        if re.fullmatch(pattern, nodeid):
            return f"CUDA only: {reason}"
    return None


def scaled(gpu, interpreted):
    """``gpu`` on a CUDA device, ``interpreted`` under the interpreter (shapes two CPU cores run in seconds)."""
    return interpreted if INTERPRETED else gpu


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def place(module: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """``module`` on the test device (in ``dtype``); under the interpreter with its backend forced to ``triton``, as
    ``auto`` takes the torch path for CPU tensors."""
    module = module.to(DEVICE) if dtype is None else module.to(DEVICE, dtype)
    if INTERPRETED:
        from benchmarks.harness.parity import set_backend
        set_backend(module, "triton")
    return module
