"""``RuntimeSettings``: how a hybrid model runs (kernels, fusions, loss chunking), apart from what it is.

A saved ``config.json`` holds the model: shapes, mixer settings, tokenizer-facing ids. How one process executes
it is chosen by that process: the ``runtime:`` section of a YAML config, ``HybridForCausalLM(config,
runtime=...)``, ``from_pretrained(path, runtime=...)`` or :meth:`HybridForCausalLM.set_runtime`. None of these
change the function the model computes; each switch is checked against its other setting by the tests
(tests/test_fused_training.py, tests/gpu/). Precision is the engine's (``optim.precision``).

A ``config.json`` that carries any of these settings (an older export) loads with them ignored
(:data:`RUNTIME_KEYS`), and the next save drops them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from hybridlm.config.structured import Section, build_dataclass, setting
from hybridlm.ops.backend import BACKENDS

# where the project has its own Triton kernel for an op that fla also has: which one the Triton path runs
KERNEL_SOURCES = ("project", "fla")


@dataclass
class RuntimeSettings(Section):
    # "auto": fla's Triton kernels for CUDA tensors when fla imports, the torch path otherwise; "triton" requires
    # them (an error on CPU); "torch" forces the torch path (to compare paths on a GPU)
    backend: str = setting("auto", choices=BACKENDS)
    # the LM-head cross-entropy runs over this many row chunks, so full logits never exist at once
    loss_chunks: int = setting(8, ge=1)
    # training: each block's residual add inside the next norm's kernel, as fla's models train
    # (docs/design.md, "Fused training paths")
    fuse_residual_norm: bool = True
    # training: a sublayer's input projections as one GEMM over their concatenated weights
    fuse_projections: bool = True
    # training: the short conv writes each block the scan takes as its own tensor
    split_conv_outputs: bool = True
    # training: the mixers' projection gradients assembled where their consumers write them, not concatenated
    # (hybridlm/ops/gradient_slots.py)
    projection_grads_in_place: bool = True
    # GDN / KDA: where the split conv runs, it also L2-normalises q and k and repeats GDN's q / k heads for its
    # grouped value heads (hybridlm/ops/causal_conv.py ``HeadNorm``)
    qk_norm_in_conv: bool = True
    # Mamba2, training on the Triton path: the SSD's inputs through torch.compile (hybridlm/ops/mamba2_inputs.py;
    # BENCHMARKS.md, "Training step breakdown"); off by default: the first step compiles
    compile_ssd_inputs: bool = False
    # decoding, Triton path: a cached Mamba2 token in one fused kernel between its two GEMMs
    # (hybridlm/ops/mamba2_step.py; BENCHMARKS.md, "Generation throughput"); off is the generation bench's
    # --mamba2-fused-step off
    mamba2_fused_step: bool = True
    # decoding: MLA's absorbed attention of a decode step through the split-K Triton kernel
    # (hybridlm/ops/latent_decode.py): SDPA walks the whole cache with one thread block a row, so its time grows
    # with the context far faster than the bytes read; the kernel spreads the keys over the GPU, and the step
    # then grows little from a 1k to an 8k context (BENCHMARKS.md, "The MLA decode kernel"); off is SDPA (the
    # generation bench's --mla-split-k off)
    mla_split_k_decode: bool = True
    # decoding: a captured CUDA-graph step runs its norms and SwiGLU through fla's fused Triton kernels instead of
    # the torch ops an eager decode step uses (one graph node a norm where the torch ops are four;
    # hybridlm/ops/backend.py; BENCHMARKS.md, "The decode fast path: what each piece is worth"); off is the
    # generation bench's --graph-small-kernels off
    graph_small_kernels: bool = True
    # decoding: a captured step leaves each block's residual add to the next norm's kernel
    # (hybridlm/ops/backend.py): 60 fewer kernels a step (BENCHMARKS.md, "The decode fast path: what each piece is
    # worth"); off is the generation bench's --graph-fuse-residual off
    graph_fuse_residual: bool = True
    # Triton path: the mixers' short convs through the project's kernel (hybridlm/ops/causal_conv.py) or fla's
    # causal_conv1d; "fla" also turns off the split conv (split_conv_outputs)
    conv_kernel: str = setting("project", choices=KERNEL_SOURCES)
    # Triton path: the RMSNorms and residual-add RMSNorms (hybridlm/ops/rms_norm.py), GDN's SiLU-gated and
    # Mamba2's output norms (hybridlm/ops/gated_norm.py) through the project's kernels or fla's
    norm_kernel: str = setting("project", choices=KERNEL_SOURCES)
    # Triton path: the LM-head cross-entropy of each chunk through the project's kernel
    # (hybridlm/ops/cross_entropy.py) or fla's fused cross-entropy
    loss_kernel: str = setting("project", choices=KERNEL_SOURCES)


RUNTIME_KEYS = tuple(f.name for f in dataclasses.fields(RuntimeSettings))
# the settings a captured decode step bakes in: a model's kept decoder (hybridlm/model/graphs.py) serves a
# generate call only under the values it was captured with
DECODE_RUNTIME_KEYS = ("mamba2_fused_step", "mla_split_k_decode", "graph_small_kernels", "graph_fuse_residual",
                       "norm_kernel")


def runtime_settings(value: Union[None, RuntimeSettings, Mapping[str, Any]], where: str = "runtime") -> RuntimeSettings:
    """``value`` as checked settings: None gives the defaults, a mapping is read strictly (one-line errors naming
    ``where.key``), a :class:`RuntimeSettings` is checked and returned as is."""
    if value is None:
        return RuntimeSettings()
    if isinstance(value, RuntimeSettings):
        value.validate(where)
        return value
    return build_dataclass(RuntimeSettings, value, where)


def moved_key_error(where: str, key: str) -> Optional[str]:
    """The message for a runtime setting given in a model section (where older configs had them), else None."""
    if key in RUNTIME_KEYS:
        return (f"{where}.{key}: how the model runs, not what it is; set runtime.{key} instead "
                f"(the model config no longer holds runtime settings)")
    return None


__all__ = ["RuntimeSettings", "KERNEL_SOURCES", "RUNTIME_KEYS", "DECODE_RUNTIME_KEYS", "runtime_settings",
           "moved_key_error"]
