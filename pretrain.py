#!/usr/bin/env python
"""Entry point: ``deepspeed pretrain.py --config configs/experiments/X.yaml [section.key=value ...]``
(or ``python pretrain.py ...`` for one process; ``--dry-run`` prints the model summary and exits)."""
from pretrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
