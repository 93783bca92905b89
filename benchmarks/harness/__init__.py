"""The measurements that benchmarks/*.sh run and BENCHMARKS.md cites: Triton-vs-torch parity and per-mixer timing,
loss parity against fla's and transformers' models, generation speed, step profiles and trace gaps, kernel
compilation reports and the init ablations. Each module with a ``main`` runs as ``python -m benchmarks.harness.NAME``
from the repository root."""
