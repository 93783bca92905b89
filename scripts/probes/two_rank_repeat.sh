#!/usr/bin/env bash
# Repeat the bf16 two-rank engine test's command N times (default 20) and count exits: the check for the
# intermittent "terminate called without an active exception" abort (BENCHMARKS.md, "Default test suite").
#   bash scripts/probes/two_rank_repeat.sh [N] [PRECISION]
set -u
cd "$(dirname "$0")/../.."
n=${1:-20} prec=${2:-bf16} fails=0
for i in $(seq 1 "$n"); do
  out=$(mktemp -d)
  port=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 timeout 250 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 \
    --nnodes 1 --master_addr 127.0.0.1 --master_port "$port" tests/engine_worker.py --out "$out" \
    --precision "$prec" --steps 6 --save-at 3 --nan-step 2 > "$out/stdout.txt" 2> "$out/stderr.txt"
  rc=$?
  if [ "$rc" -ne 0 ] || grep -q "terminate called" "$out/stderr.txt"; then
    fails=$((fails + 1)); echo "run $i: exit $rc, logs in $out"
  else
    rm -rf "$out"
  fi
done
echo "$prec two-rank worker: $fails failures in $n runs"
