"""Which threads a rank still has after the engine is released and the process groups are torn down
(BENCHMARKS.md, "Default test suite": gloo threads alive at interpreter teardown).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 scripts/probes/teardown_threads.py [bf16|fp32]

Prints per rank the thread count with the engine alive, after it is released, and the thread names left after
``shutdown_distributed()`` (each gloo process group runs one ``gloo_tcp_loop`` and two ``pt_gloo_runloop``), with
no ``gc.collect()`` between the shutdown and the count. Also the process groups torch still lists before the
shutdown, and the functions of torch.distributed.nn.functional whose ``group`` default pins a live ProcessGroup
(docs/distributed_teardown.md: that default is what kept the world group alive; expected: none).
"""
import gc
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import engine_worker as W  # noqa: E402

from hybridlm.engine import Engine, init_distributed, shutdown_distributed  # noqa: E402


def thread_names():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def pinned_defaults():
    """Functions of torch.distributed.nn.functional whose default arguments hold a ProcessGroup."""
    import torch.distributed as dist
    mod = sys.modules.get("torch.distributed.nn.functional")
    return sorted(n for n, f in (vars(mod) if mod else {}).items()
                  if any(isinstance(d, dist.ProcessGroup) for d in (getattr(f, "__defaults__", None) or ())))


def main(precision: str) -> None:
    info = init_distributed()
    engine = Engine(W.build_model(0), W.make_config(precision), W.loss_fn)
    engine.train_step(W.local_micro_batches(W.global_batches(1, 4)[0], info.rank, info.world_size, 2))
    alive = len(thread_names())
    engine.ds_engine.destroy()
    del engine
    gc.collect()
    released = len(thread_names())
    from torch.distributed.distributed_c10d import _world
    groups = sorted(_world.pg_names.values())
    pinned = pinned_defaults()
    shutdown_distributed()
    print(json.dumps({"rank": info.rank, "precision": precision, "threads_engine_alive": alive,
                      "threads_engine_released": released, "groups_before_shutdown": groups,
                      "pinned_defaults": pinned, "after_shutdown": thread_names()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bf16")
