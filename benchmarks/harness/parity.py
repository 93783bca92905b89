"""Compare a module's Triton path with its torch path on the same weights and inputs (GPU)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict

import torch
from torch import nn

from hybridlm.model.runtime import RuntimeSettings


def set_backend(module: nn.Module, backend: str) -> None:
    """Force every sublayer (and nested norm) of ``module`` onto one path: a model through its ``set_runtime``, a
    bare sublayer by giving its modules a copy of their runtime settings with ``backend`` (one copy per shared
    object, so modules that shared settings still do)."""
    if hasattr(module, "set_runtime"):
        module.set_runtime(backend=backend)
        return
    copies = {}
    for m in module.modules():
        settings = vars(m).get("runtime")
        if isinstance(settings, RuntimeSettings):
            if id(settings) not in copies:
                copies[id(settings)] = dataclasses.replace(settings, backend=backend)
            m.runtime = copies[id(settings)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def run_path(module: nn.Module, backend: str, make_input: Callable[[], torch.Tensor],
             loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
    """One forward and backward of ``module`` on ``backend`` with seeded input and output weights; returns the
    output and the gradients of the parameters and (as ``"<input>"``) of a floating-point input, in fp32."""
    set_backend(module, backend)
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    x = make_input()
    if x.is_floating_point():
        x.requires_grad_(True)
    out = loss_of(module, x)
    torch.manual_seed(1)
    w = torch.randn_like(out.float())
    (out.float() * w).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in module.named_parameters() if p.grad is not None}
    if x.is_floating_point():
        grads["<input>"] = x.grad.detach().float().clone()
    set_backend(module, "auto")
    return out.detach().float(), grads


def relative_errors(run, reference) -> Dict[str, float]:
    """Relative L2 errors of one :func:`run_path` result against another: output, input gradient, the worst
    parameter gradient (and its name), and every parameter's under ``"per_param"``."""
    (out, grads), (ref_out, ref_grads) = run, reference
    errs = {"output": _rel(out, ref_out)}
    if "<input>" in ref_grads:
        errs["grad_input"] = _rel(grads["<input>"], ref_grads["<input>"])
    per_param = {n: _rel(grads[n], g) for n, g in ref_grads.items() if n != "<input>" and g.norm() > 0}
    worst = max(per_param, key=per_param.get)
    errs["grad_params_max"] = per_param[worst]
    errs["worst_param"] = worst
    errs["per_param"] = per_param
    return errs


def compare_paths(module: nn.Module, make_input: Callable[[], torch.Tensor],
                  loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Dict[str, float]:
    """Relative L2 errors (Triton vs torch) of the loss/output and of the gradients of input and parameters.

    Returns ``{"output": e, "grad_input": e, "grad_params_max": e, "worst_param": name}``.
    """
    errs = relative_errors(run_path(module, "triton", make_input, loss_of),
                           run_path(module, "torch", make_input, loss_of))
    errs.pop("per_param")
    return errs
