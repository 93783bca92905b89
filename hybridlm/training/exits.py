"""How the training CLIs end: one line and an exit status per kind of stop, never a traceback for an expected one.

0 done; 2 bad configuration or input (``error:``); 3 stopped on repeated non-finite losses, checkpoint saved
(``error:``); 4 the environment failed, not the input (``error:``): the disk is full (the partial files
removed), or the run directory is in use by another process; 143 stopped by a pre-emption signal, checkpoint
saved, rerun to resume (``stopped:``).
"""
from __future__ import annotations

import sys
from typing import Callable, Tuple, Type

from hybridlm.config.errors import ConfigError
from hybridlm.engine.engine import NonFiniteLossError
from hybridlm.training.lock import RunDirectoryInUse
from hybridlm.training.preempt import EXIT_CODE as PREEMPTED_EXIT_CODE, Preempted
from hybridlm.utils.atomic import DiskFullError

ENVIRONMENT_EXIT_CODE = 4


def run_cli(fn: Callable[[], object], user_errors: Tuple[Type[BaseException], ...] = (ConfigError,)) -> int:
    """Run ``fn`` and turn the expected ways a run stops into (message on stderr, exit status)."""
    try:
        fn()
    except user_errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:  # the run stopped itself, its checkpoint saved: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (DiskFullError, RunDirectoryInUse) as e:  # the machine, not the input: a stated status
        print(f"error: {e}", file=sys.stderr)
        return ENVIRONMENT_EXIT_CODE
    except Preempted as e:  # a scheduler's signal: the checkpoint is saved, the next run resumes
        print(f"stopped: {e}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0
