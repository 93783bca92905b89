"""tests/serve/server.py without vLLM: a server that never comes up, and one that ignores SIGTERM and leaves a child
behind, are reaped with their whole process group; a server that comes up is reached on 127.0.0.1."""
import os
import sys
import time

import pytest

from tests.serve.server import HOST, free_port, serving

# a stand-in for vLLM's start-up: ignores SIGTERM, starts a child that ignores it too, writes both pids, never serves
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent has already exited
        return f.read().split(") ")[-1][0] != "Z"


def test_a_server_past_its_start_up_time_is_reaped_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(AssertionError, match="did not come up in 3 s"):
        with serving([sys.executable, "-c", STUBBORN, str(pids)], tmp_path / "log",
                     f"http://{HOST}:{free_port()}/health", startup_s=3, grace=1):
            pass
    leader, child = (int(p) for p in pids.read_text().split())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:  # orphaned by the kill: init reaps it
        time.sleep(0.1)
    assert not _alive(leader) and not _alive(child)


def test_a_server_that_comes_up_is_reached_on_localhost_and_reaped(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", HOST, "--directory", str(tmp_path)]
    (tmp_path / "health").write_text("ok")
    with serving(argv, tmp_path / "log", f"http://{HOST}:{port}/health", startup_s=60) as proc:
        assert proc.poll() is None
    assert proc.poll() is not None
