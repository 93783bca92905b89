"""How far a bf16 training step's gradients are from fp32 on the torch path (CPU), with the two-block models of
tests/gpu/test_fused_training_gpu.py (same weights, same batch). The scale that test's bound is set against: the
decay's gradients (``a_proj``, ``A_log``, ``dt_bias``) sum over every position of a head, and a bf16 run is a few
percent from fp32 there whatever path it takes (BENCHMARKS.md, "Numerics"). Runs on the CPU, from a checkout
(it imports the tests' model builder), in under a minute.

    python benchmarks/bf16_gradient_error.py [--patterns G-G- K-K- S-S- *-*-] [--top 4]

Prints, per pattern, the loss in both precisions and the parameters whose bf16 gradient is furthest from fp32.
"""
import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "gpu")]

from conftest import rel_err  # noqa: E402
from test_fused_training_gpu import UNFUSED, _loss_and_grads, _model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--patterns", nargs="+", default=["G-G-", "K-K-", "S-S-", "*-*-"])
    p.add_argument("--top", type=int, default=4)
    args = p.parse_args()
    for pattern in args.patterns:
        # as the test: the bf16 model's weights, in fp32 for the referee
        bf16 = _model(pattern, backend="torch", device="cpu", **UNFUSED).to(torch.bfloat16)
        fp32 = _model(pattern, backend="torch", device="cpu", **UNFUSED)
        fp32.load_state_dict({n: t.float() for n, t in bf16.state_dict().items()})
        ids = torch.randint(1, 1024, (2, 512), generator=torch.Generator().manual_seed(1))
        (loss_h, grads_h), (loss_f, grads_f) = (_loss_and_grads(m, ids) for m in (bf16, fp32))
        errors = sorted(((rel_err(grads_h[n], grads_f[n]), n) for n in grads_f if grads_f[n].norm() > 0),
                        reverse=True)
        print(f"{pattern}  loss bf16 {loss_h:.4f}  fp32 {loss_f:.4f}")
        for err, name in errors[:args.top]:
            print(f"    {err:.4f}  {name}")


if __name__ == "__main__":
    main()
