"""The benchmarks behind BENCHMARKS.md, run from a checkout's root (``python -m benchmarks.train_speed``,
``python -m benchmarks.harness.generation``); not part of the installed toolkit."""
