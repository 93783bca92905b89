"""The run directory's lock (hybridlm/training/lock.py) is made without following links and never writes outside
the run folder: a ``.lock`` that is a link, a directory, another kind of file, immutable, or on a read-only
filesystem is one ``error:`` line and exit 4, the file elsewhere untouched; a finished stage on a read-only mount
still reports itself finished. Rank 0 alone takes the lock however the ranks were launched."""
import contextlib
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from distill.kd import KD_SECTIONS, kd_configs, run_kd
from hybridlm.config.loader import load_config
from hybridlm.training.exits import run_cli
from hybridlm.training.lock import RunDirectoryInUse, RunDirectoryUnusable, RunLock
from hybridlm.training.shell import RunShell, export_model
from hybridlm.utils.atomic import write_json


def kd_argv(out, *extra):
    """A KD stage command on ``out``: it checks its config, then meets the lock before reading anything else."""
    return [sys.executable, "-m", "upcycle.cli", "kd", "--config", "configs/upcycle/smollm2_kd_cpu.yaml",
            "student.path=no/student/needed/before/the/lock", f"run.output_dir={out}", *extra]


def one_error_line(proc):
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and lines and lines[-1].startswith("error: "), proc.stderr[-2000:]
    assert [ln for ln in lines if ln.startswith(("error:", "stopped:"))] == [lines[-1]], proc.stderr[-2000:]
    return lines[-1]


def kd_in_process(out, capsys):
    """The KD stage command's work in this process: (exit status, stdout, stderr)."""
    configs = kd_configs(load_config("configs/upcycle/smollm2_kd_cpu.yaml",
                                     ["student.path=no/student/needed/before/the/lock", f"run.output_dir={out}"],
                                     sections=KD_SECTIONS))
    code = run_cli(lambda: run_kd(configs))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("not the run's\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    code, _, err = kd_in_process(out, capsys)
    assert code == 4 and err.strip().splitlines() == [err.strip()] and err.startswith("error: "), err
    assert "is a symbolic link" in err and str(out / ".lock") in err, err
    assert victim.read_text() == "not the run's\n" and (out / ".lock").is_symlink()


def test_a_dangling_link_creates_nothing_where_it_points(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(tmp_path / "would_be_created")
    with pytest.raises(RunDirectoryUnusable, match="is a symbolic link"):
        RunLock(out).acquire()
    assert not (tmp_path / "would_be_created").exists()


@pytest.mark.parametrize("kind, message", [("directory", "is a directory"), ("fifo", "is not a regular file"),
                                           ("hard link", "has other hard links")])
def test_a_lock_that_is_not_the_runs_own_plain_file_is_refused(tmp_path, kind, message):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / ".lock"
    other = tmp_path / "other.txt"
    if kind == "directory":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        other.write_text("another file's content\n")
        os.link(other, lock)
    with pytest.raises(RunDirectoryUnusable, match=message):
        RunLock(out).acquire()
    if kind == "hard link":
        assert other.read_text() == "another file's content\n"


def test_a_held_lock_is_still_refused_naming_its_holder(tmp_path):
    """(flock conflicts between two opens of the file, in one process as in two)"""
    held = RunLock(tmp_path / "run").acquire()
    try:
        with pytest.raises(RunDirectoryInUse, match=f"in use by process {os.getpid()}"):
            RunLock(tmp_path / "run").acquire()
    finally:
        held.release()
    assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
    RunLock(tmp_path / "run").acquire().release()  # free again once released


@contextlib.contextmanager
def immutable(path):
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root and a filesystem with attributes")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("what", ["folder", "lock"])
def test_an_immutable_folder_or_lock_is_one_line(tmp_path, what):
    out = tmp_path / "run"
    out.mkdir()
    if what == "lock":
        (out / ".lock").write_text("")
    with immutable(out if what == "folder" else out / ".lock"):
        with pytest.raises(RunDirectoryUnusable, match="cannot be created or opened for writing .*immutable"):
            RunLock(out).acquire()


@contextlib.contextmanager
def read_only_view(src, dst):
    """``dst``: a read-only bind mount of ``src`` (root only)."""
    dst.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True).returncode != 0:
        pytest.skip("a read-only bind mount needs root (CAP_SYS_ADMIN)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True, capture_output=True)
        yield dst
    finally:
        subprocess.run(["umount", str(dst)], check=True)


def finished_stage(out):
    """A stage directory as a finished stage leaves it: ``final/`` exported with its marker and ``stage.json``."""
    def write(tmp):
        (tmp / "config.json").write_text("{}\n")
        write_json(tmp / "stage.json", {"stage": "kd", "steps": 2, "config": {"kd": {}}})
    export_model(out / "final", write, amendable=("stage.json",))


def test_a_finished_stage_on_a_read_only_mount_reports_itself_finished(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    finished_stage(tmp_path / "src" / "kd")
    (tmp_path / "src" / "unfinished").mkdir()
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        code, out, err = kd_in_process(ro / "kd", capsys)
        assert code == 0 and "kd: already finished" in out and not err.strip(), err
        code, _, err = kd_in_process(ro / "unfinished", capsys)
        assert code == 4 and err.startswith("error: ") and "read-only filesystem" in err, err
        assert err.strip().splitlines() == [err.strip()]


@pytest.mark.slow  # the same as operators meet them: the `upcycle kd` command in its own process
def test_the_stage_command_on_a_link_and_on_a_read_only_mount(tmp_path):
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("not the run's\n")
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / ".lock").symlink_to(victim)
    proc = subprocess.run(kd_argv(tmp_path / "link"), cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    line = one_error_line(proc)
    assert proc.returncode == 4 and "is a symbolic link" in line and victim.read_text() == "not the run's\n", line
    finished_stage(tmp_path / "src" / "kd")
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        done = subprocess.run(kd_argv(ro / "kd"), cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0 and "kd: already finished" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("env, holds", [({"RANK": "1"}, False), ({"OMPI_COMM_WORLD_RANK": "1"}, False),
                                        ({"OMPI_COMM_WORLD_RANK": "0"}, True), ({}, True)])
def test_rank_zero_is_asked_one_way_before_the_group_exists(tmp_path, monkeypatch, env, holds):
    """An MPI launcher names the rank only in its own variable (DeepSpeed sets RANK when it opens the group): a
    rank other than 0 must not take the lock then either."""
    import hybridlm.utils.ranks as ranks
    monkeypatch.setattr(ranks.dist, "is_initialized", lambda: False)  # before the group: an earlier test may hold one
    for var in ("RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with RunShell(tmp_path / "run") as shell:
        assert (shell.lock is not None) == holds


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two gloo ranks, twice
@pytest.mark.parametrize("launch", ["torchrun", "plain env"])
def test_two_ranks_have_one_lock_holder(tmp_path, launch):
    out = tmp_path / "run"
    script = str(REPO / "tests" / "support" / "lock_ranks.py")
    port = str(free_port())
    if launch == "torchrun":  # the launcher exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* (as the deepspeed one does)
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes",
                                   "1", "--master_addr", "127.0.0.1", "--master_port", port, script, str(out)],
                                  cwd=REPO, env=subprocess_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)]
    else:  # the same variables set by hand on two plain processes
        procs = [subprocess.Popen([sys.executable, script, str(out)], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=subprocess_env(OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                                                     WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                     MASTER_PORT=port))
                 for r in (0, 1)]
    reports = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        reports += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    reports.sort(key=lambda r: r["rank"])
    assert [(r["rank"], r["rank_before_group"], r["holds"]) for r in reports] == [(0, 0, True), (1, 1, False)]
    assert all(r["holders"] == 1 for r in reports)
