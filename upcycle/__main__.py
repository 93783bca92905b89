"""The ``upcycle`` command (its console script) and ``python -m upcycle``: :func:`upcycle.cli.main`, with SIGTERM /
SIGUSR1 held, blocked, from the first statement through the imports (seconds) until ``main`` installs their one
owner (hybridlm/training/preempt.py), which takes over a signal that came meanwhile (`stopped:`, exit 143)."""
import signal

signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1))

from upcycle.cli import main  # noqa: E402  (after the signals are held)

if __name__ == "__main__":
    raise SystemExit(main())
