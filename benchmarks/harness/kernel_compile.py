"""The project's Triton kernels compiled for an H200 (sm_90) on a machine without a GPU: what ptxas made of them.

    python -m benchmarks.harness.kernel_compile [--kernels conv] [--out kernel_compile.jsonl]

Triton compiles ahead of time for a named target without a driver (``triton.compile`` of an ``ASTSource`` with a
``GPUTarget``; its bundled ptxas and cuobjdump). For each kernel and launch configuration this reports the
registers a thread uses, its stack (spills), and how many global loads and stores are 16-byte vectors against
8-byte vectors, words and scalar 2-byte ones: the static facts that decide a memory-bound kernel's speed,
visible without a GPU. It times nothing. Arguments are specialised as the JIT specialises real tensors (pointers
and integers divisible by 16). One JSON line per compiled configuration.

Cases (``--kernels``): ``conv``, the short conv's forward and backward pass 1 (hybridlm/ops/causal_conv.py) with one
output and with three (``causal_conv_split``'s q | k | v at GDN-300M's widths), and with q and k's heads normalised
and repeated in them, at channel blocks (and, for pass 1, rows per iteration and whether the pre-activation comes
from the products' x tile) the autotuner may pick. ``gated_norm``: the gated output norm's backward at both mixers' shapes.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import Dict, Iterator, List

import hybridlm.ops.causal_conv as conv
import hybridlm.ops.gated_norm as gn
from hybridlm.utils.atomic import json_text

WIDTHS = ("v4", "v2", "b32", "b16")  # a vector of 4 or 2 words, one 4-byte word, one 2-byte element


def count_accesses(ptx: str) -> Dict[str, int]:
    """Global loads and stores in ``ptx`` by width (:data:`WIDTHS`; the vector qualifier decides where there is
    one): ``{"ld_v4": ..., "st_b16": ...}``."""
    counts = {f"{op}_{w}": 0 for op in ("ld", "st") for w in WIDTHS}
    for op, qualifiers in re.findall(r"\b(ld|st)\.global((?:\.[\w:]+)*)", ptx):
        quals = qualifiers.split(".")
        width = next((w for w in WIDTHS if w in quals), None)
        if width is not None:
            counts[f"{op}_{width}"] += 1
    return counts


def compile_for_gpu(fn, pointers: Dict[str, str], constexprs: Dict[str, object], num_warps: int,
                    arch: int = 90) -> Dict[str, int]:
    """Compile the ``triton.jit`` function ``fn`` for ``sm_<arch>``: ``pointers`` maps pointer arguments to their
    Triton type (``"*bf16"``), other non-constexpr arguments are ``i32``. Returns registers, stack bytes and its
    global accesses by width (:func:`count_accesses`). A float argument is typed ``"fp32"`` in ``pointers``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in fn.arg_names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if signature[a] not in ("constexpr", "fp32")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=divisible)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    found = {k: re.search(rf"{k}:(\d+)", usage) for k in ("REG", "STACK")}
    if None in found.values():
        raise RuntimeError(f"kernel_compile: no register / stack figures in cuobjdump's output: {usage!r}")
    return {"registers": int(found["REG"].group(1)), "stack_bytes": int(found["STACK"].group(1)),
            **count_accesses(compiled.asm["ptx"])}


def conv_cases() -> Iterator[Dict[str, object]]:
    """The short conv's forward and backward pass 1, one output segment against three (q | k | v at GDN-300M's
    widths, 256 + 256 + 512), bf16, width 4, at channel blocks and warps from their autotuning configurations; and
    the three with q and k's heads of 64 normalised and repeated twice (``HeadNorm``: the block is the head)."""
    forward, pass1, _ = (k.fn for k in conv._kernels())  # under their autotuners
    bf16 = "*bf16"
    plain = {"NW": 0, "REPEAT": 1, "HEAD": 0}
    for nseg, D0, D1, norm in ((1, 1024, 0, plain), (3, 256, 256, plain),
                               (3, 256, 256, {"NW": 512, "REPEAT": 2, "HEAD": 64})):
        split = {"D": 1024, "D0": D0, "D1": D1, "NSEG": nseg, "W": 4, "BT": conv.BT, "HAS_BIAS": False, "SILU": True,
                 **norm}
        head_norm = norm["NW"] > 0
        for bd, warps in ((64, 4), (128, 4), (256, 8), (64, 8)):
            if head_norm and bd != norm["HEAD"]:
                continue
            yield {"kernel": "causal_conv forward", "segments": nseg, "head_norm": head_norm, "BD": bd,
                   "num_warps": warps,
                   **compile_for_gpu(forward, {**dict.fromkeys(("x", "w", "b", "y0", "y1", "y2"), bf16), "eps": "fp32"},
                                     {**split, "BD": bd}, warps)}
        pointers = {**dict.fromkeys(("x", "w", "b", "dy0", "dy1", "dy2", "da"), bf16), "dw": "*fp32", "db": "*fp32",
                    "eps": "fp32"}
        for bd, warps, tiles in ((16, 4, 1), (32, 4, 1), (32, 8, 32), (64, 8, 32), (64, 4, 1)):
            if head_norm and bd != norm["HEAD"]:
                continue
            for rows in (16, conv.BT):
                for once in (False, True):
                    if once and not conv.x_once_fits(rows, bd, warps):  # the autotuner never runs these
                        continue
                    constexprs = {**split, "BD": bd, "WP": 4, "TILES": tiles, "BR": rows, "X_ONCE": once}
                    yield {"kernel": "causal_conv backward pass 1", "segments": nseg, "head_norm": head_norm,
                           "BD": bd, "num_warps": warps, "tiles": tiles, "BR": rows, "X_ONCE": once,
                           **compile_for_gpu(pass1, pointers, constexprs, warps)}


def gated_norm_cases() -> Iterator[Dict[str, object]]:
    """The gated output norm's backward (hybridlm/ops/gated_norm.py), bf16, at Mamba2-300M's groups (2,048 channels
    in 8 groups, the D skip) and GDN-300M's heads (8 heads of 64 sharing the weight), dz's rows strided as a block
    of the projection's gradient."""
    for name, C, group, skip, heads in (("mamba2", 2048, 256, True, 32), ("gdn", 512, 64, False, 8)):
        backward = gn._kernels(group)[1].fn  # under its autotuner
        pointers = {**dict.fromkeys(("y", "x", "z", "D", "w", "dout", "dy", "dxs", "dz"), "*bf16"),
                    **dict.fromkeys(("rstd", "dw", "dd"), "*fp32")}
        constexprs = {"NG": C // group, "HD": C // heads, "GS": group, "WS": C if skip else group,
                      "NORM_FIRST": not skip, "HAS_SKIP": skip}
        for rows, warps in ((8, 4), (32, 8)):
            yield {"kernel": f"gated_norm backward ({name})", "BR": rows, "num_warps": warps,
                   **compile_for_gpu(backward, pointers, {**constexprs, "BR": rows}, warps)}


CASES = {"conv": conv_cases, "gated_norm": gated_norm_cases}


def main(argv=None) -> List[Dict[str, object]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    rows = [row for name in args.kernels for row in CASES[name]()]
    text = "".join(json_text(r) + "\n" for r in rows)
    print(text, end="")
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
