"""A server process a test starts and always reaps: in a process group of its own (vLLM's OpenAI server starts
its engine in child processes), listening on 127.0.0.1 only, stopped with its whole group on every way out of the
test (a failed start-up, a start-up past its time, an assertion), by SIGTERM and then SIGKILL: during start-up vLLM
does not act on SIGTERM."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator, List

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def reap(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop ``proc`` and every process of its group: SIGTERM, ``grace`` seconds, then SIGKILL for what is left
    (the leader that ignored SIGTERM, or children it left behind)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    proc.wait(timeout=30)


@contextlib.contextmanager
def serving(argv: List[str], log: Path, health_url: str, startup_s: float = 300.0,
            grace: float = 20.0) -> Iterator[subprocess.Popen]:
    """Run ``argv`` (output to ``log``) in its own process group until ``health_url`` answers, yield it, and reap
    it and its group on the way out, whatever the way (:func:`reap`, ``grace`` seconds after SIGTERM)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"the server exited with {proc.returncode} during start-up:\n"
                                         + log.read_text()[-3000:])
                if time.monotonic() > deadline:
                    raise AssertionError(f"the server did not come up in {startup_s:.0f} s:\n"
                                         + log.read_text()[-3000:])
                try:
                    urllib.request.urlopen(health_url, timeout=5)
                    break
                except OSError:
                    time.sleep(1)
            yield proc
        finally:
            reap(proc, grace)
