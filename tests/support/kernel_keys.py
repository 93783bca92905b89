"""The Triton autotuner launches (kernel name and tuning key) a run makes on a GPU, worked out on a CPU.

A shipped tuning file (hybridlm/ops/tuning.py) serves a launch only where its kernel, tuning key and candidates match
an entry; a launch it lacks tunes on the GPU at first use (seconds to a minute each). The tuning key is what Triton's
``Autotuner.run`` builds from the launch's arguments: the values of the autotuner's ``key`` arguments, then the dtype
of every tensor argument. These follow from the model's shapes, dtypes, batch and a few GPU facts, not from the data,
so this module runs the model code of each run on ``meta`` tensors with every Triton launch recorded instead of run:

- ``Autotuner.run`` records ``(kernel name, str(key))`` as Triton builds it (autotuners of one candidate, or with a
  ``pre_hook``, are never served from a file and are left out); ``JITFunction.run`` launches nothing;
- the models take the Triton path on those tensors (``use_triton`` answers yes; ``interpreting`` no);
- fla's shared-memory check answers for the GPU the file names (it picks block sizes that enter some keys).

Checked against a real record: GDN-300M's training step at micro-batch 16 x 2048 gives exactly the 22 launches an
H100 recorded for it. Run in a process of its own (the patches hold for the whole process):

    python -m tests.support.kernel_keys [RUN ...]      # JSON {run: [[kernel, key], ...]} on stdout
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

# fla's hardware check reads the device's largest shared memory per block (fla/utils/hardware.py Backend); the
# shipped files' GPUs are Hopper parts
SHARED_MEM = {"NVIDIA H100 80GB HBM3": 232448, "NVIDIA H200": 232448}

Launch = Tuple[str, str, Optional[str]]  # kernel name, tuning key, the project's kernels' source hash
_SEEN: Set[Launch] = set()


def _jit_function(autotuner):
    from triton.runtime.jit import JITFunction
    fn = autotuner.fn
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def _record(self, *args, **kwargs):
    """``Autotuner.run`` without the launch: the tuning key as triton/runtime/autotuner.py builds it."""
    if len(self.configs) <= 1 or any(c.pre_hook for c in self.configs):
        return None
    named = {**dict(zip(self.arg_names, args)), **kwargs}
    named = {k: v for k, v in named.items() if k in self.arg_names}
    key = [named[k] for k in self.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    fn = _jit_function(self)
    # the source hash covers the constant globals a kernel reads; fla's read hardware flags (fla/utils), which differ
    # off the GPU, so only the project's own kernels' hashes are worked out here (fla's follow its pinned version)
    source = fn.cache_key if fn.fn.__module__.startswith("hybridlm.") else None
    _SEEN.add((fn.__name__, str(tuple(key)), source))
    return None


class _AnyDevice(list):
    def __init__(self, value: int):
        super().__init__([value])
        self.value = value

    def __getitem__(self, index):  # fla indexes by the tensor's device index (None on meta tensors)
        return self.value


def install(gpu: str = "NVIDIA H100 80GB HBM3") -> None:
    """Record instead of launch, for the rest of this process, with fla's hardware checks answering for ``gpu``."""
    if gpu not in SHARED_MEM:
        raise ValueError(f"no hardware facts for {gpu!r} (known: {', '.join(SHARED_MEM)})")
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import fla.utils.hardware as hardware
    Autotuner.run = _record
    JITFunction.run = lambda self, *args, **kwargs: None
    hardware.get_all_max_shared_mem = lambda: _AnyDevice(SHARED_MEM[gpu])
    hardware.check_shared_mem.cache_clear()

    import importlib
    from hybridlm.ops import backend, triton_launch
    original_use, original_interp = backend.use_triton, triton_launch.interpreting
    for name in ("hybridlm.model.modeling", "hybridlm.model.layers.delta_rule", "hybridlm.model.layers.mamba2",
                 "hybridlm.model.layers.mla", "hybridlm.model.layers.kda", "distill.kd_loss",
                 "hybridlm.ops.causal_conv", "hybridlm.ops.gated_norm", "hybridlm.ops.rms_norm",
                 "hybridlm.ops.swiglu_packed", "hybridlm.ops.cross_entropy", "hybridlm.ops.kd_divergence"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    for module in list(sys.modules.values()):
        if getattr(module, "use_triton", None) is original_use:
            module.use_triton = lambda backend_name, x: backend_name != "torch"
        if getattr(module, "interpreting", None) is original_interp:
            module.interpreting = lambda: False


def launches(fn: Callable[[], None]) -> List[Launch]:
    """The autotuned launches ``fn`` makes (after :func:`install`), sorted."""
    _SEEN.clear()
    fn()
    return sorted(_SEEN, key=str)


# ------------------------------------------------------------------------------------------- the runs
def _meta(build):
    with torch.device("meta"):
        return build()


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.zeros((batch, length), dtype=torch.long, device="meta")


def _train(model, batch: int, length: int) -> None:
    """A training step's forward and backward through the model's body and head."""
    model.set_runtime(backend="triton")
    model(_ids(batch, length)).logits.float().sum().backward()


def _forward(model, batch: int, length: int) -> None:
    model.set_runtime(backend="triton")
    with torch.no_grad():
        model(_ids(batch, length))


def pretrain_step(config: str, micro_batch: int, overrides=()) -> None:
    """``pretrain.py --config config`` at ``micro_batch``: the model in its training precision, one step."""
    from hybridlm.config.loader import load_config
    from hybridlm.model import HybridConfig, HybridForCausalLM
    from hybridlm.engine.config import COMPUTE_DTYPES
    cfg = load_config(config, overrides)
    precision = cfg["optim"].get("precision", "bf16")
    if precision != "bf16":
        raise ValueError(f"{config}: precision {precision!r}: only bf16 (weights in bf16) is worked out here")
    dtype = getattr(torch, COMPUTE_DTYPES[precision])
    model = _meta(lambda: HybridForCausalLM(HybridConfig.from_user_dict(cfg["model"])).to(dtype))
    _train(model, micro_batch, int(cfg["data"].get("seq_len", 2048)))


def _route_student(kinds: str):
    """The route's student at SmolLM2-135M's shapes (benchmarks/route_twin.py) of ``kinds``: ``mla`` / ``mamba2``
    (the pure students of init and ILD) or ``hybrid`` (8 MLA, Mamba2 elsewhere)."""
    from benchmarks.route_twin import route_config
    from hybridlm.model import HybridForCausalLM
    from upcycle.student import student_config
    llama, hybrid = route_config()
    cfg = hybrid if kinds == "hybrid" else student_config(llama, [kinds] * llama.num_hidden_layers,
                                                          kv_lora_rank=128, qk_rope_head_dim=16)
    return _meta(lambda: HybridForCausalLM(cfg))


def _teacher_trace(batch: int, length: int, dtype: torch.dtype):
    """What distill/ild.py ``teacher_trace`` hands the student per teacher layer (input, attention output, layer
    output: ``[batch, length, width]`` each): the teacher (a transformers Llama, no Triton) is not run."""
    from benchmarks.route_twin import SMOLLM2
    shape = (batch, length, SMOLLM2["hidden_size"])
    return [tuple(torch.empty(shape, dtype=dtype, device="meta") for _ in range(3))
            for _ in range(SMOLLM2["num_hidden_layers"])]


def route_ild(kind: str, micro_batch: int, length: int) -> None:
    """ILD of the ``kind`` student in bf16 (distill/ild.py ``ild_loss``: each layer fed the teacher's input)."""
    import distill.ild as ild
    student = _route_student(kind).to(torch.bfloat16)
    student.set_runtime(backend="triton")
    trace = _teacher_trace(micro_batch, length, torch.bfloat16)
    real, ild.teacher_trace = ild.teacher_trace, lambda teacher, input_ids: trace
    try:
        ild.ild_loss(student, None, _ids(micro_batch, length))[0].backward()
    finally:
        ild.teacher_trace = real


def route_calibration(batch: int, length: int) -> None:
    """init's calibration of the Mamba2 student in fp32 (upcycle/calibrate.py ``fit_output_scale``: each linear
    mixer on its normed teacher input, no gradient)."""
    student = _route_student("mamba2")
    student.set_runtime(backend="triton")
    with torch.no_grad():
        for i, (x, _, _) in enumerate(_teacher_trace(batch, length, torch.bfloat16)):
            block = student.model.layers[2 * i]
            block.mixer(block.norm(x.float()))


def route_train(micro_batch: int, length: int) -> None:
    """KD or DPO of the route's hybrid in bf16 (DPO's micro-batch holds chosen and rejected: twice the pairs)."""
    _train(_route_student("hybrid").to(torch.bfloat16), micro_batch, length)


@dataclass(frozen=True)
class Run:
    """A run whose launches a shipped file must hold: what it is, and the model code it runs."""
    name: str
    what: str
    fn: Callable[[], None]


# The acceptance run (benchmarks/acceptance.py) at its own settings: pre-training GDN-300M at micro-batch 16, the
# route smoke on the twin (micro-batch 2 x 256 tokens; DPO's 2 pairs make 4 rows; calibration 8 windows of 256);
# the route at configs/upcycle/smollm2_route_h200.yaml's micro-batch 64 x 1024; and each shipped pre-training config
# at the micro-batch of benchmarks/train_speed.sh (64; 16 for the 1B).
RUNS: Dict[str, Run] = {r.name: r for r in (
    Run("acceptance-pretrain", "the acceptance's pretrain.py: gdn_300m at micro-batch 16 x 2048 (bf16)",
        lambda: pretrain_step("configs/experiments/gdn_300m.yaml", 16)),
    Run("acceptance-route-calibration", "init's calibration of the Mamba2 student, 8 x 256 tokens (fp32)",
        lambda: route_calibration(8, 256)),
    Run("acceptance-route-ild-mla", "ILD of the MLA student, micro-batch 2 x 256 (bf16)",
        lambda: route_ild("mla", 2, 256)),
    Run("acceptance-route-ild-mamba2", "ILD of the Mamba2 student, micro-batch 2 x 256 (bf16)",
        lambda: route_ild("mamba2", 2, 256)),
    Run("acceptance-route-kd", "KD of the hybrid, micro-batch 2 x 256 (bf16)", lambda: route_train(2, 256)),
    Run("acceptance-route-dpo", "DPO of the hybrid, 2 pairs x 256 (bf16)", lambda: route_train(4, 256)),
    Run("route-ild-mla", "smollm2_route_h200.yaml: ILD of the MLA student, micro-batch 64 x 1024 (bf16)",
        lambda: route_ild("mla", 64, 1024)),
    Run("route-ild-mamba2", "smollm2_route_h200.yaml: ILD of the Mamba2 student, micro-batch 64 x 1024 (bf16)",
        lambda: route_ild("mamba2", 64, 1024)),
    Run("route-kd", "smollm2_route_h200.yaml: KD of the hybrid, micro-batch 64 x 1024 (bf16)",
        lambda: route_train(64, 1024)),
) + tuple(
    Run(f"train-speed-{name}", f"benchmarks/train_speed.sh: configs/experiments/{name}.yaml at micro-batch "
                               f"{micro} x 2048 (bf16)",
        lambda name=name, micro=micro: pretrain_step(f"configs/experiments/{name}.yaml", micro))
    for name, micro in (("gdn_300m", 64), ("gdn_300m_hybrid", 64), ("kda_300m", 64), ("mamba2_300m", 64),
                        ("mamba2_300m_hybrid", 64), ("gdn_1b", 16)))}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tests.support.kernel_keys", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", metavar="RUN", help=f"default: all ({', '.join(RUNS)})")
    ap.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", choices=sorted(SHARED_MEM))
    args = ap.parse_args(argv)
    unknown = [n for n in args.runs if n not in RUNS]
    if unknown:
        ap.error(f"unknown run {unknown[0]!r}")
    install(args.gpu)
    print(json.dumps({n: launches(RUNS[n].fn) for n in args.runs or RUNS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
