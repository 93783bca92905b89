"""``python -m hybridlm.eval`` = ``hybrid-eval`` (see :mod:`hybridlm.eval.cli`)."""
import sys

from hybridlm.eval.cli import main

sys.exit(main())
