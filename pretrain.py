#!/usr/bin/env python
"""Entry point: ``deepspeed pretrain.py --config configs/experiments/X.yaml [section.key=value ...]``
(or ``python pretrain.py ...`` for one process; ``--dry-run`` prints the model summary and exits)."""
import signal

# first: SIGTERM / SIGUSR1 wait, blocked, through the imports (seconds) until main() installs their one owner
# (hybridlm/training/preempt.py), which takes over one that came meanwhile: it stops with a `stopped:` line
signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1))

from pretrain.cli import main  # noqa: E402  (after the signals are held)

if __name__ == "__main__":
    raise SystemExit(main())
