"""One rank of the two-rank lock test: enters the run shell before the process group exists (as every CLI does),
then opens the group and prints one JSON line: its rank, the rank it saw before the group, whether it holds the
run directory's lock, and how many ranks hold it (summed over the group)."""
import json
import sys

from hybridlm.engine import all_reduce_sum, barrier, init_distributed
from hybridlm.training.shell import RunShell
from hybridlm.utils.ranks import launch_rank

if __name__ == "__main__":
    before = launch_rank()
    with RunShell(sys.argv[1]) as shell:
        holds = shell.lock is not None
        info = init_distributed()
        holders = all_reduce_sum([float(holds)])[0]
        barrier()
    print(json.dumps({"rank": info.rank, "rank_before_group": before, "holds": holds, "holders": holders}))
