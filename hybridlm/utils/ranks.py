"""This process's global rank, asked one way before and after the process group exists.

The run shell takes a run directory's lock before the process group is opened, so "am I rank 0" cannot wait for
``torch.distributed``: the launcher's environment answers until the group exists (``RANK`` from the deepspeed
launcher or torchrun; an MPI launcher's own variable, which DeepSpeed turns into ``RANK`` only when it opens the
group), and the group answers after.
"""
from __future__ import annotations

import os

import torch.distributed as dist

MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def launch_rank() -> int:
    """The process group's rank once it exists, else the launcher's (``RANK``, then the MPI variables), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for var in ("RANK", *MPI_RANK_VARS):
        value = os.environ.get(var, "").strip()
        if value:
            return int(value)
    return 0


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 (:func:`launch_rank`): the one that takes a run directory's lock and
    writes the run's shared files."""
    return launch_rank() == 0
