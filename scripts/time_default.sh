#!/usr/bin/env bash
# Wall time of the embedded default (the README's first command after the set-up) from a fresh output folder and
# fresh prepared data, alone and then with another CPU-bound job beside it (the same run, started at the same time):
#   bash scripts/time_default.sh [OUT_DIR]        (default /tmp/hybridlm-time-default)
# Prints the seconds of each run and the ratio; the sample of the first run ends its log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/hybridlm-time-default}
PY=${PYTHON:-.venv/bin/python}
rm -rf "$OUT" && mkdir -p "$OUT"
run() {  # run NAME: one default run into $OUT/NAME, its seconds into $OUT/NAME.seconds
  local t0=$EPOCHREALTIME
  "$PY" pretrain.py --config configs/experiments/default_cpu.yaml run.output_dir="$OUT/$1/run" \
      data.path="$OUT/$1/data" run.progress=false > "$OUT/$1.log" 2>&1
  "$PY" -c "print(round($EPOCHREALTIME - $t0, 1))" > "$OUT/$1.seconds"
}
run alone
run beside_a & run beside_b & wait
alone=$(cat "$OUT/alone.seconds"); a=$(cat "$OUT/beside_a.seconds"); b=$(cat "$OUT/beside_b.seconds")
echo "alone: ${alone} s; two at once: ${a} s and ${b} s ($("$PY" -c "print(f'{($a + $b) / 2 / $alone:.2f}')")x the" \
     "time alone; a fair share of the cores is 2.00x)"
echo "sample of the first run:"; grep -A3 '^sample' "$OUT/alone.log" || tail -n 3 "$OUT/alone.log"
