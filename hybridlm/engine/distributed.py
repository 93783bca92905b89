"""Process-group setup shared by every stage.

``init_distributed()`` works in three situations without any flags:

* launched by ``deepspeed`` (single- or multi-node via a hostfile) or ``torchrun``: the launcher
  exports ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
* launched by ``mpirun``: DeepSpeed reads the MPI environment itself (needs ``mpi4py``);
* a plain ``python script.py``: we export a one-process world (rank 0, a free local port) so
  DeepSpeed does not go looking for MPI.

On CUDA the backend is NCCL and each process binds ``cuda:LOCAL_RANK``; without CUDA it is gloo on
the CPU accelerator.  Calling it again returns the same :class:`DistInfo`.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_INFO: Optional[DistInfo] = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _launched() -> bool:
    return "RANK" in os.environ or any(v in os.environ for v in _MPI_RANK_VARS)


def _disable_shm_comm_build() -> None:
    """Stop DeepSpeed from JIT-compiling its CPU shared-memory collective op (~200 s per process).

    ``deepspeed.comm`` only uses that op when ``deepspeed.ops.__compatible_ops__`` says it is
    buildable; training here goes through plain gloo/NCCL collectives and never needs it.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(timeout_minutes: int = 30) -> DistInfo:
    """Initialise ``torch.distributed`` through DeepSpeed (idempotent) and return this process's place."""
    global _INFO
    if _INFO is not None and dist.is_available() and dist.is_initialized():
        return _INFO
    atexit.register(_destroy_at_exit)  # a second registration after a re-init only adds a no-op

    cuda = torch.cuda.is_available()
    if not cuda:
        # Must be set before DeepSpeed first resolves its accelerator; harmless if it already did
        # (it auto-detects the CPU accelerator when no CUDA device exists).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not _launched():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))

    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"

    _disable_shm_comm_build()

    import deepspeed

    if not (dist.is_available() and dist.is_initialized()):
        deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    else:  # someone else created the group: let DeepSpeed's comm layer adopt it
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        backend = str(dist.get_backend())

    _INFO = DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
    )
    return _INFO


def get_dist_info() -> DistInfo:
    """The :class:`DistInfo` of an initialised process (initialising a one-process world if needed)."""
    return init_distributed()


def is_main() -> bool:
    """True on global rank 0, and in a process that never initialised distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == 0


def world_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def barrier() -> None:
    """Wait for every rank; a no-op in a one-process world."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # naming the device spares nccl its guess (and the warning that a guess may hang)
        on_gpu = dist.get_backend() == "nccl"
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_gpu else None)


def _destroy_groups() -> None:
    """Destroy every process group, through DeepSpeed's comm layer when it adopted them: it also drops the groups
    DeepSpeed keeps (its clone of the world group), whose gloo threads torch's ``destroy_process_group`` alone
    leaves running into interpreter teardown, where a thread ended mid-destructor aborts the rank ("terminate
    called without an active exception")."""
    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    elif dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _destroy_at_exit() -> None:
    """Tear the groups down before interpreter teardown (see :func:`_destroy_groups`)."""
    if dist.is_available() and dist.is_initialized():
        _destroy_groups()


def shutdown_distributed() -> None:
    """Wait for every rank, then tear the process groups down (see :func:`_destroy_groups`)."""
    global _INFO
    if dist.is_available() and dist.is_initialized():
        barrier()
        _destroy_groups()
    _INFO = None


def all_reduce_flag(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (one tiny all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    device = _INFO.device if _INFO is not None else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_reduce_sum(values: Sequence[float]) -> List[float]:
    """Element-wise sum of ``values`` over all ranks (e.g. eval loss sums and token counts)."""
    vals = [float(v) for v in values]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not vals:
        return vals
    device = _INFO.device if _INFO is not None else torch.device("cpu")
    t = torch.tensor(vals, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()
