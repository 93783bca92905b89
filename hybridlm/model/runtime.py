"""``RuntimeSettings``: how a hybrid model runs (kernels, fusions, loss chunking), apart from what it is.

A saved ``config.json`` holds the model: shapes, mixer settings, tokenizer-facing ids. How one process executes
it is chosen by that process: the ``runtime:`` section of a YAML config, ``HybridForCausalLM(config,
runtime=...)``, ``from_pretrained(path, runtime=...)`` or :meth:`HybridForCausalLM.set_runtime`. None of these
change the function the model computes; each switch is checked against its other setting by the tests
(tests/test_fused_training.py, tests/gpu/). Precision is the engine's (``optim.precision``).

Exports written before these settings left the model config carry them in ``config.json``; loading such a folder
ignores them (:data:`RUNTIME_KEYS`), and the next save drops them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from hybridlm.config.structured import Section, build_dataclass, setting
from hybridlm.ops.backend import BACKENDS


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


RUNTIME_KEYS = tuple(f.name for f in dataclasses.fields(RuntimeSettings))


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


__all__ = ["RuntimeSettings", "RUNTIME_KEYS", "runtime_settings", "moved_key_error"]
