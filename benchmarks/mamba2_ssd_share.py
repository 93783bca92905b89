"""How much the SSD contributes at initialisation, next to the D skip, in one Mamba2 layer of mamba2_300m's shape
(hidden 1024, d_state 64, head_dim 64, 8 groups, expand 2) on unit-RMS random input, for three conv inits:
fla's normal(0, 0.02) with bias 0 (our Mamba2's before; ``legacy:mamba2_conv_fla``), PyTorch's Conv1d weight
U(+-1/sqrt(width)) with bias 0, and PyTorch's Conv1d default for weight and bias (mamba_ssm's, transformers' and now
ours). in_proj is normal(0, 0.02) in all three.

    python benchmarks/mamba2_ssd_share.py

Prints rms(SSD output), rms(D x) and their ratio (docs/initialisation.md; BENCHMARKS.md, "Loss parity": the
Mamba2 init). Runs on the CPU, from a checkout (it imports the tests' config builder), in seconds;
tests/test_init.py's bound rests on it.
"""
import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import hybridlm.model.layers.mamba2 as mamba2_module  # noqa: E402
from conftest import tiny_config  # noqa: E402
from hybridlm.model.layers.init import init_short_conv, init_short_conv_uniform  # noqa: E402

CONV_INITS = {
    "fla: conv normal(0, 0.02), bias 0 (ours before)": lambda conv: init_short_conv(conv, 0.02),
    "conv U(+-0.5), bias 0": lambda conv: (init_short_conv(conv, 0.02),
                                           init_short_conv_uniform(conv, weight=True, bias=False)),
    "Conv1d default: U(+-0.5), bias U(+-0.5) (ours)": lambda conv: init_short_conv_uniform(conv),
}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=__doc__).parse_args()
    cfg = tiny_config("M", "mamba2", hidden_size=1024,
                      mamba2=dict(d_state=64, head_dim=64, n_groups=8, expand=2, conv_size=4))
    real = mamba2_module.chunk_gated_recurrence
    seen = {}

    def spy(q, k, v, g, **kw):
        y, state = real(q, k, v, g, **kw)
        seen.update(ssd=y, x=v)
        return y, state

    mamba2_module.chunk_gated_recurrence = spy
    try:
        for name, init in CONV_INITS.items():
            torch.manual_seed(0)
            layer = mamba2_module.Mamba2(cfg.mixer_args("mamba2"), cfg.hidden_size, runtime=cfg.runtime)
            torch.nn.init.normal_(layer.in_proj.weight, std=0.02)
            with torch.no_grad():
                init(layer.conv1d)
                layer(torch.randn(1, 512, 1024))
            ssd, skip = seen["ssd"].pow(2).mean().sqrt(), seen["x"].pow(2).mean().sqrt()  # D = 1
            print(f"{name:<46} rms(SSD) {ssd:.2e}  rms(D x) {skip:.2e}  SSD / skip {ssd / skip:.4f}")
    finally:
        mamba2_module.chunk_gated_recurrence = real


if __name__ == "__main__":
    main()
