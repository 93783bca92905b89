"""SIGTERM / SIGUSR1 are requests (hybridlm/training/preempt.py): one owner, installed from an entry point's first
line, records them; the program stops at safe points with one ``stopped:`` line and exit 143. A signal never
becomes an exception inside whatever runs, so no ``except Exception`` renames it into an error about an input and
no finalizer swallows it, and a signal before the owner exists waits for it instead of killing the process."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, subprocess_env
from hybridlm.config.errors import ConfigError
from hybridlm.training.exits import run_cli
from hybridlm.training.preempt import EXIT_CODE, STOP, Preempted
from hybridlm.training.shell import RunShell
from test_fault_campaign import pretrain_argv


@pytest.fixture(autouse=True)
def no_owner_yet():
    """Each test starts without the owner (a CLI's main() called in-process keeps it installed, as a program does)."""
    STOP.uninstall()
    yield
    STOP.uninstall()


@pytest.fixture
def owned():
    """STOP installed for the test, and given back after it."""
    before = signal.getsignal(signal.SIGTERM)
    STOP.install()
    yield STOP
    STOP.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_handler_records_and_raises_nothing_into_the_code_it_interrupts(owned):
    caught = []
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs here, between bytecodes
    except Exception as e:  # what a library's broad `except` would have turned into an error about its input
        caught.append(e)
    assert caught == [] and owned.requested and owned.signal_name == "SIGTERM"
    os.kill(os.getpid(), signal.SIGUSR1)  # the first signal is the one reported
    time.sleep(0.01)
    with pytest.raises(Preempted, match=r"^stopped by SIGTERM as the test asked; rerun"):
        owned.check("as the test asked")


class _Finalized:
    def __del__(self):  # a signal that lands in a finalizer: Python prints and drops what a finalizer raises
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)


def _drop_in_finalizer():
    _Finalized()  # freed at once: __del__ runs, the signal arrives inside it
    return {"done": True}


def test_a_signal_in_a_finalizer_is_not_lost(capsys):
    code = run_cli(_drop_in_finalizer)
    err = capsys.readouterr().err
    assert code == EXIT_CODE == 143, err
    assert err.strip().splitlines() == ["stopped: stopped by SIGTERM as the command finished; its results are complete;"
                                        " rerun to go on from there"]
    assert "Exception ignored" not in err and not STOP.installed


def _load_that_catches_everything():
    """A load that turns any failure into a wrong input, as a model loader does (`except Exception`)."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        raise OSError("safetensors header truncated")  # what the interrupted read then reports
    except Exception as e:
        raise ConfigError(f"student.path: cannot be loaded as a hybrid ({e})") from None


def test_a_load_that_fails_after_a_signal_is_reported_stopped_not_a_bad_input(capsys):
    code = run_cli(_load_that_catches_everything)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 143 and len(err) == 1 and err[0].startswith("stopped: stopped by SIGTERM before the command could "
                                                               "finish (student.path: cannot be loaded"), err


def test_the_same_failure_without_a_signal_stays_an_error(capsys):
    def load():
        raise ConfigError("student.path: cannot be loaded as a hybrid (safetensors header truncated)")
    assert run_cli(load) == 2
    assert capsys.readouterr().err.startswith("error: student.path: cannot be loaded")


def test_the_shell_stops_at_its_start_up_point_and_gives_the_lock_back(tmp_path, owned):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    with pytest.raises(Preempted, match="stopped by SIGUSR1 as the run started"):
        with RunShell(tmp_path / "run"):
            pytest.fail("the shell must not enter with a stop requested")
    owned.uninstall()
    with RunShell(tmp_path / "run") as shell:  # the lock was given back
        assert shell.lock is not None


def _term_self_in_child(queue):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    queue.put("survived")


def test_a_forked_worker_is_ended_by_sigterm_not_recorded(owned):
    """A data worker forked from the owner gets the default handlers: a pool's terminate() ends it."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_term_self_in_child, args=(queue,))
    child.start()
    child.join(10)
    assert child.exitcode == -signal.SIGTERM and queue.empty()
    assert not owned.requested  # the parent's owner saw nothing


@pytest.mark.slow  # real signals at a real command's start (imports, the shell), in subprocesses
@pytest.mark.parametrize("sig, after", [(signal.SIGUSR1, 1.0), (signal.SIGTERM, 5.0)],
                         ids=["SIGUSR1 at 1 s", "SIGTERM at 5 s"])
def test_a_signal_before_the_shell_exists_is_one_stopped_line_and_143(tmp_path, austen_data, sig, after):
    """1 s: `pretrain.py` is still importing torch (no handler would exist yet); 5 s: loading its modules."""
    out = tmp_path / "run"
    proc = subprocess.Popen(pretrain_argv(out, austen_data), cwd=REPO, env=subprocess_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(after)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert lines[-1].startswith(f"stopped: stopped by {sig.name}") and "Traceback" not in err, err[-2000:]
    assert [ln for ln in lines if ln.startswith(("stopped:", "error:"))] == [lines[-1]]
    assert not (out / "final").exists()
