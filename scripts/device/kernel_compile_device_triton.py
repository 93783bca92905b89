"""``python -m hybridlm.bench.kernel_compile`` with the device's Triton, on a machine without a GPU.

The device runs the Triton that ``.device`` carries (3.7.1, built for its Python 3.12; ``scripts/device/README.md``),
while this machine's venv has its own (3.9.0). A kernel that compiles here may not compile there. This script
unpacks the carried Triton into ``--site`` (once) and compiles the project's kernels for sm_90 with it:

    python3.12 scripts/device/kernel_compile_device_triton.py [--kernels conv gated_norm] [--out FILE]

(with pyenv: ``PYENV_VERSION=3.12.1 python3.12 ...``). There is no torch for that Python here, so ``torch`` is a
stub module with the few names the kernels' modules touch when imported: the kernels' source does not use torch,
and nothing here runs a kernel (it compiles them). Other arguments go to ``hybridlm.bench.kernel_compile``.
"""
from __future__ import annotations

import argparse
import glob
import lzma
import os
import sys
import tarfile
import types

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def unpack_triton(site: str) -> None:
    """The carried Triton (``.device/triton-*-rest.tar.xz`` and its ``libtriton.so`` apart) into ``site``."""
    if os.path.isfile(os.path.join(site, ".ready")):
        return
    rest = glob.glob(os.path.join(REPO, ".device", "triton-*-rest.tar.xz"))
    lib = glob.glob(os.path.join(REPO, ".device", "triton-*-lib.xz"))
    if not rest or not lib:
        raise SystemExit(f"kernel_compile_device_triton: no carried Triton in {REPO}/.device (build the bundle: "
                         "../shared/device/bundle.sh)")
    os.makedirs(site, exist_ok=True)
    with tarfile.open(rest[0], "r:xz") as tar:
        tar.extractall(site, filter="fully_trusted")
    target = os.path.join(site, "triton", "_C", "libtriton.so")
    with lzma.open(lib[0]) as src, open(target, "wb") as dst:
        while chunk := src.read(1 << 24):
            dst.write(chunk)
    for path in [target, *glob.glob(os.path.join(site, "triton", "backends", "nvidia", "bin", "*"))]:
        os.chmod(path, 0o755)
    open(os.path.join(site, ".ready"), "w").close()


class _Function:
    """Stands in for ``torch.autograd.Function`` as a base class; never applied here."""

    @classmethod
    def apply(cls, *args, **kwargs):
        raise RuntimeError("torch is a stub in kernel_compile_device_triton: nothing runs here")


def stub_torch() -> None:
    """A ``torch`` module with what importing the kernels' modules needs (base classes, names in annotations)."""
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m
    torch = module("torch", Tensor=object, dtype=object, device=object, Generator=object, Size=tuple,
                   float32="float32", bfloat16="bfloat16", is_grad_enabled=lambda: False)
    torch.autograd = module("torch.autograd", Function=_Function)
    torch.nn = module("torch.nn", Module=object)
    torch.nn.functional = module("torch.nn.functional")
    torch.cuda = module("torch.cuda", is_available=lambda: False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", default="/tmp/device-triton-site", help="where the carried Triton is unpacked")
    args, rest = p.parse_known_args()
    unpack_triton(args.site)
    sys.path[:0] = [args.site, REPO]
    if "torch" in sys.modules or any(os.path.isdir(os.path.join(d, "torch")) for d in sys.path if d):
        raise SystemExit("kernel_compile_device_triton: a real torch is importable here; run this with a Python "
                         "that has none (the device's 3.12), or use python -m hybridlm.bench.kernel_compile")
    stub_torch()
    import triton
    print(f"# triton {triton.__version__} from {os.path.dirname(triton.__file__)}", file=sys.stderr)
    from hybridlm.bench import kernel_compile
    kernel_compile.main(rest)


if __name__ == "__main__":
    main()
