"""Process-group setup shared by every stage.

``init_distributed()`` works in three situations without any flags:

* launched by ``deepspeed`` (single- or multi-node via a hostfile) or ``torchrun``: the launcher
  exports ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
* launched by ``mpirun``: DeepSpeed reads the MPI environment itself (needs ``mpi4py``);
* a plain ``python script.py``: we export a one-process world (rank 0, a free local port) so
  DeepSpeed does not go looking for MPI.

On CUDA the backend is NCCL and each process binds ``cuda:LOCAL_RANK``; without CUDA it is gloo on
the CPU accelerator.  Calling it again returns the same :class:`DistInfo`.

NVLink multicast is off unless ``HYBRIDLM_NVLS=1``: before the process group exists, :func:`multicast_setting`
sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` where the
environment does not set them already (the benchmark scripts' launcher does the same, benchmarks/common.sh).
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from hybridlm import patches
from hybridlm.config.errors import ConfigError
from hybridlm.engine.deepspeed_adapter import destroy_process_groups, init_process_group
from hybridlm.utils.ranks import MPI_RANK_VARS as _MPI_RANK_VARS

# NVLink multicast off (NCCL's NVLS algorithms, torch's symmetric memory, NVSHMEM): hosts shared with other jobs
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NVLS_SETTING = "HYBRIDLM_NVLS"


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


def multicast_setting(environ=os.environ) -> dict:
    """Apply ``HYBRIDLM_NVLS`` to ``environ`` and return what it set: unset or ``0``, each variable of
    :data:`MULTICAST_OFF` the environment lacks; ``1``, nothing (the libraries' defaults: multicast where the
    host has it). A variable the user set keeps its value either way."""
    value = environ.get(NVLS_SETTING, "0")
    if value not in ("0", "1"):
        raise ConfigError(f"{NVLS_SETTING}={value}: expected 0 (NVLink multicast off, the default) or 1 (the "
                         f"libraries' defaults)")
    if value == "1":
        return {}
    applied = {k: v for k, v in MULTICAST_OFF.items() if k not in environ}
    environ.update(applied)
    return applied


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
        multicast_setting()  # read by NCCL when the group's communicators are made, later than this
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"

    patches.apply("deepspeed-shm-comm-off")
    if not (dist.is_available() and dist.is_initialized()):
        patches.apply("torch-group-defaults-unpinned")  # before the default group exists (hybridlm/patches.py)

    if not (dist.is_available() and dist.is_initialized()):
        init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    else:  # someone else created the group: let DeepSpeed's comm layer adopt it
        init_process_group(dist.get_backend())
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
    """Destroy every process group and drop what still refers to them, so that no gloo thread outlives this call.

    A gloo group's threads (``gloo_tcp_loop``, two ``pt_gloo_runloop``) stop only when the ProcessGroup object is
    freed, not when it is destroyed; one still referenced at interpreter teardown is freed mid-teardown, where a
    thread ended in its destructor can abort the rank ("terminate called without an active exception"). So:

    * destroy through DeepSpeed's comm layer when it adopted the groups: it also releases the groups DeepSpeed keeps
      in ``deepspeed.utils.groups`` (its clone of the world group, ``_WORLD_GROUP``, is the ZeRO data-parallel group);
    * drop a default group frozen into torch function defaults (hybridlm/patches.py
      ``torch-group-defaults-unpinned``);
    * collect garbage: DeepSpeed leaves the clone on each model parameter (``param._dp_group``,
      deepspeed/utils/mixed_precision_linkage.py ``_init_lp_to_hp_mapping``), and a released parameter is a
      reference cycle (its bound ``get_full_hp_param`` & co. methods) that only a collection frees. A released
      but uncollected ZeRO-1 engine takes two passes (measured: the first frees the engine, the second its
      parameters and with them the clone), so collect until a pass finds nothing.
    """
    if not destroy_process_groups() and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    patches.apply("torch-group-defaults-unpinned")
    for _ in range(5):
        if not gc.collect():
            break


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
