"""Triton kernels on a CPU through Triton's interpreter (``TRITON_INTERPRET=1``): what compiled Triton does that the
interpreter does not, patched so that the same kernels (ours and fla's) run there.

:func:`enable` must run before ``triton`` (and so ``fla``) is first imported, in a process of its own (the environment
variable and the patches hold for the whole process). It patches three differences:

1. ``triton.autotune`` benchmarks every config, which needs a GPU: the patched ``Autotuner`` keeps the first config
   only (triton/runtime/autotuner.py ``Autotuner.__init__``).
2. Compiled Triton gives the loop variable of ``range`` / ``tl.range`` tensor semantics (fla writes
   ``i_t.to(tl.int64)``); the interpreter runs the loop as a Python loop over ints. The interpreter already rewrites
   each kernel's AST (triton/runtime/interpreter.py ``ASTTransformer``: ``x = value`` becomes
   ``x = interpreter_semantic.to_tensor(value, False)``); the patched transformer also rebinds the loop variable of
   every ``for NAME in range(...)`` / ``tl.range(...)`` loop the same way at the top of the body
   (``tl.static_range`` loops keep ints: they may index tuples).
3. Compiled Triton rounds fp32 -> bf16 to nearest even (``.to(tl.bfloat16)``); the interpreter truncates
   (triton/runtime/interpreter.py ``InterpreterBuilder.cast_impl``): :func:`round_bf16_like_gpu`.
"""
from __future__ import annotations

import ast
import os
import sys

_DONE = False
_LOOPS = {"range", "tl.range", "triton.language.range"}


def _callee(node) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def enable() -> None:
    """Interpreter on, autotuning to one config, loop variables as interpreter tensors. Idempotent."""
    global _DONE
    if _DONE:
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton_interpreter.enable() must run before triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"

    from triton.runtime import autotuner, interpreter

    init = autotuner.Autotuner.__init__

    def first_config_only(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:1] if configs else configs, *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config_only

    class LoopVarTransformer(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            if isinstance(node.target, ast.Name) and _callee(node.iter) in _LOOPS:
                name = node.target.id
                rebind = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                      attr="to_tensor", ctx=ast.Load()),
                                   args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                                   keywords=[]))
                node.body.insert(0, ast.copy_location(rebind, node))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVarTransformer()
    _DONE = True


def round_bf16_like_gpu() -> None:
    """Make the interpreter round fp32 -> bf16 to nearest even, as compiled Triton does, so that bf16 runs compare
    rounding for rounding. Idempotent."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl
    if getattr(cast, "rounds_like_gpu", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    cast_impl.rounds_like_gpu = True
    interpreter.InterpreterBuilder.cast_impl = cast_impl


def poison_uninitialized_memory() -> None:
    """``torch.empty`` memory filled with NaN (integers with their largest value): an output a kernel leaves partly
    unwritten then fails its comparison, instead of passing on what the allocator hands back (once, the memory the
    torch path's identical result had just freed). The deterministic-algorithms switch it needs only warns."""
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
