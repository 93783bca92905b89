#!/usr/bin/env bash
# ZeRO-1 on several GPUs of one host (BENCHMARKS.md, "Several GPUs"): data-parallel scaling of pre-training, its loss
# curve against one GPU's, the resume of a checkpoint on another number of GPUs, a rank killed mid-step, and the
# upcycling route on several GPUs against one. Every launch of several ranks goes through DeepSpeed's launcher
# (benchmarks/common.sh's launch: NVLink multicast off unless HYBRIDLM_NVLS=1).
#
#   bash benchmarks/multigpu.sh OUT_DIR [PART ...]
#
# Parts (default: scaling losses resume kill; route only when named). N is the largest of NGPUS, M = N / 2.
#   scaling  python -m benchmarks.train_speed (pretrain.py's own step, checkpoints off) on GDN-300M at micro-batch
#            64 and GDN-1B at 16 per GPU, 10 steps after 3, at each of NGPUS: tokens/s, per GPU, scaling
#            efficiency against one GPU, each rank's peak memory and ZeRO-1 optimizer shard (fp32 master weights and
#            AdamW moments: about 1 / N of one GPU's). OUT_DIR/scaling_<config>.json from OUT_DIR/speed_<config>_<n>gpu/
#   losses   pretrain.py on GDN-300M, LOSS_STEPS steps at global batch 128 x 2048 (micro-batch 16: 8 accumulation
#            steps on one GPU, 1 on 8), on 1 GPU and on N over the same batches: every step's loss and the
#            validation losses compared. OUT_DIR/losses.json, runs in OUT_DIR/loss_<n>gpu/
#   resume   pretrain.py on GDN-300M at the same global batch, 30 steps: uninterrupted on N; stopped by SIGTERM
#            after step 20 on N (its checkpoint saved) and resumed on M and on 1; stopped on M and resumed on N;
#            each resumed run's losses from step 21 against the uninterrupted run's. OUT_DIR/resume.json
#   kill     the same run on N with a checkpoint every 10 steps; rank N-1 SIGKILLed inside step 16: the seconds until
#            every rank has stopped, the launcher's status, the ranks left alive and the error lines
#            (OUT_DIR/kill.json); then the same command again: it resumes at its last checkpoint (step 10) and
#            its losses are compared with the uninterrupted run's (OUT_DIR/kill_rerun.json)
#   route    benchmarks/route.sh with NGPU=1 (or ROUTE_ONE, an earlier one-GPU route's OUT_DIR) and NGPU=N on
#            ROUTE_CONFIG: each model's perplexities and cloze accuracy and each stage's minutes, compared
#            (OUT_DIR/route.json); `upcycle plan --gpus N` with the micro-batches route.sh used
#            (OUT_DIR/plan_<n>gpu.txt): its GiB per rank and hours per stage beside the measured minutes and the
#            most memory each GPU had in use during the route (nvidia-smi every second, OUT_DIR/route_<n>gpu.memory.csv)
# A part's report already in OUT_DIR is kept: run the same command again to go on after a stop. Progress and the
# runs' output: OUT_DIR/multigpu.log and OUT_DIR/*.log.
# Data: DATA (default data_cache/janeausten-llama3.2, prepared from Jane Austen's novels when missing).
#
# Settings (environment):
#   NGPUS="1 2 4 8"        rank counts of scaling (those above the visible GPUs are left out); N is the largest
#   SCALING_CONFIGS="gdn_300m:64 gdn_1b:16"   configs of scaling with their micro-batch per GPU
#   SEQ=2048               tokens per sequence of scaling
#   LOSS_STEPS=200         steps of the losses part
#   PRETRAIN_CONFIG=configs/experiments/gdn_300m.yaml   the recipe of losses, resume and kill
#   PRETRAIN_OVERRIDES="k=v ..."   more pretrain.py overrides for those, after the parts' own (e.g. a smaller model
#                          for a quick pass: "model.num_layers=4")
#   ROUTE_CONFIG=configs/upcycle/smollm2_route_h200.yaml   ROUTE_ONE=DIR (an earlier NGPU=1 route.sh OUT_DIR)
#   RTOL=0.01              relative loss / perplexity difference the reports call within (bf16 noise)
#   and those of benchmarks/common.sh (PYTHON, CUDA_VISIBLE_DEVICES, HYBRIDLM_NVLS, MASTER_PORT, TRITON_CACHE_DIR, ...)
source "$(dirname "$0")/common.sh"
bench_start "bash benchmarks/multigpu.sh OUT_DIR [scaling|losses|resume|kill|route ...]" "$@"
shift
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(scaling losses resume kill)
for part in "${PARTS[@]}"; do
  case "$part" in
    scaling|losses|resume|kill|route) ;;
    *) fail "unknown part '$part' (expected: scaling losses resume kill route)" ;;
  esac
done
[ "${#GPUS[@]}" -ge 2 ] || fail "$BENCH_NAME needs at least 2 visible GPUs; ${#GPUS[@]} visible (CUDA_VISIBLE_DEVICES)"
COUNTS=()
for n in ${NGPUS:-1 2 4 8}; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || fail "NGPUS: '$n' is not a GPU count"
  [ "$n" -le "${#GPUS[@]}" ] && COUNTS+=("$n")
done
[ ${#COUNTS[@]} -gt 0 ] || fail "NGPUS=${NGPUS:-}: none of these fits the ${#GPUS[@]} visible GPUs"
N=$(printf '%s\n' "${COUNTS[@]}" | sort -n | tail -n 1)
[ "$N" -ge 2 ] || fail "NGPUS=${NGPUS:-}: the largest count must be at least 2"
M=$(( N / 2 ))
RTOL=${RTOL:-0.01}
PRETRAIN_CONFIG=$(user_path "${PRETRAIN_CONFIG:-configs/experiments/gdn_300m.yaml}")
[ -f "$PRETRAIN_CONFIG" ] || fail "PRETRAIN_CONFIG=$PRETRAIN_CONFIG: no such file"
multicast_env  # HYBRIDLM_NVLS checked before any work; every launch below inherits the setting
bench_log multigpu.log
DATA=$(user_path "${DATA:-data_cache/janeausten-llama3.2}")
prepare_data "$DATA"
MULTICAST=$([ "${HYBRIDLM_NVLS:-0}" = 1 ] && echo "the libraries' default" || echo off)
say "multigpu: parts ${PARTS[*]}; ranks ${COUNTS[*]} (N=$N, M=$M) of GPUs ${GPUS[*]}; multicast $MULTICAST; $PY"

# run_ranks N LOG ARGS...: ARGS (a script, or --module NAME, and its arguments) on N GPUs (one process without the
# launcher when N = 1), output into LOG
run_ranks() {
  local n=$1 log=$2; shift 2
  if [ "$n" -gt 1 ]; then launch "$n" "$@"
  elif [ "$1" = --module ]; then shift; CUDA_VISIBLE_DEVICES=${GPUS[0]} "$PY" -m "$@"
  else CUDA_VISIBLE_DEVICES=${GPUS[0]} "$PY" "$@"; fi > "$log" 2>&1
}

# pretrain_args DIR STEPS [OVERRIDE ...]: ARGS=(pretrain.py on GDN-300M at global batch 128 x 2048, micro-batch 16
# per GPU, into DIR)
pretrain_args() {
  local dir=$1 steps=$2; shift 2
  # shellcheck disable=SC2206  # PRETRAIN_OVERRIDES splits into words on purpose
  ARGS=(pretrain.py --config "$PRETRAIN_CONFIG" "data.path=$DATA" optim.micro_batch_size=16
        optim.global_batch_size=128 optim.warmup_steps=10 "optim.max_steps=$steps" run.log_interval=1
        data.val_max_batches=4 run.sample_tokens=0 run.progress=false run.export=false "run.output_dir=$dir" "$@"
        ${PRETRAIN_OVERRIDES:-})
}

# the uninterrupted 30-step run on N GPUs that resume and kill compare with (a finished run is not trained again)
reference_run() {
  REF=$OUT/reference_${N}gpu
  say "reference: 30 steps on $N GPUs ($REF)"
  pretrain_args "$REF" 30 run.eval_interval=10 run.save_interval=10
  run_ranks "$N" "$OUT/reference_${N}gpu.log" "${ARGS[@]}" \
    || fail "the reference run failed ($OUT/reference_${N}gpu.log)"
}

failed=()
part_scaling() {
  local spec config mb n dir
  for spec in ${SCALING_CONFIGS:-gdn_300m:64 gdn_1b:16}; do
    config=${spec%%:*}; mb=${spec#*:}
    [[ $mb =~ ^[1-9][0-9]*$ ]] || fail "SCALING_CONFIGS: '$spec' is not CONFIG:MICRO_BATCH"
    for n in "${COUNTS[@]}"; do
      dir=$OUT/speed_${config}_${n}gpu
      [ -f "$dir/train_speed.json" ] && { say "scaling $config on $n GPU(s): kept ($dir)"; continue; }
      say "scaling $config on $n GPU(s), micro-batch $mb"
      if ! run_ranks "$n" "$dir.log" --module benchmarks.train_speed --out "$dir" --data "$DATA" --configs "$config" \
          --peers --micro-batch "$mb" --seq "${SEQ:-2048}" --steps 10 --warmup 3; then
        failed+=("scaling:$config:$n")
        rm -f "$dir/train_speed.json"  # measured again on the next run
      fi
      grep -E "tok/s|OOM|Error" "$dir.log" | tail -n 2
    done
  done
  # one report per config: the rank counts of that config against its one-GPU run
  for spec in ${SCALING_CONFIGS:-gdn_300m:64 gdn_1b:16}; do
    config=${spec%%:*}
    local have=()
    for n in "${COUNTS[@]}"; do
      dir=$OUT/speed_${config}_${n}gpu
      [ -f "$dir/train_speed.json" ] && have+=("$n=$dir/train_speed.json")
    done
    [ ${#have[@]} -gt 0 ] || continue
    "$PY" -m benchmarks.multigpu scaling --speed "${have[@]}" --out "$OUT/scaling_$config.json" \
      || failed+=("scaling:$config:report")
  done
  say "scaling: $(ls "$OUT"/scaling_*.json 2>/dev/null | tr '\n' ' ')"
}

part_losses() {
  local steps=${LOSS_STEPS:-200} n
  for n in 1 "$N"; do
    say "losses: $steps steps on $n GPU(s) ($OUT/loss_${n}gpu)"
    pretrain_args "$OUT/loss_${n}gpu" "$steps" run.eval_interval=50 run.save_interval=50
    run_ranks "$n" "$OUT/loss_${n}gpu.log" "${ARGS[@]}" || { failed+=("losses:$n"); return; }
  done
  "$PY" -m benchmarks.multigpu losses --reference "$OUT/loss_1gpu" --run "${N}gpu=$OUT/loss_${N}gpu" --rtol "$RTOL" \
    --out "$OUT/losses.json" || failed+=("losses:report")
}

# saved_at_20 DIR: the run's last checkpoint is of step 20 (step_20, or step_20.K for a step saved again)
saved_at_20() { grep -qE '^step_20(\.[0-9]+)?$' "$1/checkpoints/latest" 2>/dev/null; }

# saved_run RANKS: 30 steps on RANKS GPUs stopped by SIGTERM (a scheduler's notice) after step 20, its checkpoint
# saved, exit 143; a run stopped so already is kept
saved_run() {
  local n=$1 dir=$OUT/saved_${1}gpu
  saved_at_20 "$dir" && { say "resume: the run saved on $n GPU(s) kept ($dir)"; return 0; }
  rm -rf "$dir"
  say "resume: 30 steps on $n GPU(s), stopped after step 20 ($dir)"
  pretrain_args "$dir" 30 run.eval_interval=10 run.save_interval=100
  HYBRIDLM_FAULT_TERM_AT_STEP=20 run_ranks "$n" "$dir.log" "${ARGS[@]}"
  saved_at_20 "$dir" || { echo "error: no checkpoint of step 20 in $dir ($dir.log)" >&2; return 1; }
}

# resumed_run FROM TO: a copy of the run saved on FROM GPUs resumed on TO
resumed_run() {
  local dir=$OUT/resumed_${1}to${2}gpu
  if [ ! -f "$dir/result.json" ]; then
    rm -rf "$dir"
    cp -a "$OUT/saved_${1}gpu" "$dir" || return 1
    say "resume: saved on $1 GPU(s), resumed on $2 ($dir)"
    pretrain_args "$dir" 30 run.eval_interval=10 run.save_interval=100
    run_ranks "$2" "$dir.log" "${ARGS[@]}" || return 1
    grep -m 1 "^resumed from" "$dir.log"
  fi
  RESUMED+=("${1}to${2}=$dir")
}

part_resume() {
  reference_run
  RESUMED=()
  local from to
  for from in "$N" "$M"; do
    saved_run "$from" || { failed+=("resume:save$from"); continue; }
    if [ "$from" = "$N" ]; then
      for to in $(printf '%s\n' "$M" 1 | sort -un); do resumed_run "$N" "$to" || failed+=("resume:${N}to$to"); done
    else
      resumed_run "$M" "$N" || failed+=("resume:${M}to$N")
    fi
  done
  [ ${#RESUMED[@]} -gt 0 ] || return
  "$PY" -m benchmarks.multigpu losses --reference "$REF" --run "${RESUMED[@]}" --after-step 20 --rtol "$RTOL" \
    --out "$OUT/resume.json" || failed+=("resume:report")
}

part_kill() {
  [ -f "$OUT/kill_rerun.json" ] && { say "kill: kept ($OUT/kill.json, $OUT/kill_rerun.json)"; return; }
  reference_run
  local dir=$OUT/killed_${N}gpu
  pretrain_args "$dir" 30 run.eval_interval=10 run.save_interval=10
  if ! grep -qs '"stopped": true' "$OUT/kill.json"; then
    rm -rf "$dir"
    say "kill: rank $(( N - 1 )) of $N killed inside step 16 ($dir)"
    # the same launch as launch() (common.sh), through the rank killer
    multicast_env
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${GPUS[*]:0:$N}") "$PY" -m benchmarks.multigpu kill --rank $(( N - 1 )) \
      --after-step 15 --metrics "$dir/metrics.jsonl" --log "$OUT/killed_${N}gpu.log" --out "$OUT/kill.json" -- \
      "$PY" -m deepspeed.launcher.runner --master_port "${MASTER_PORT:-29500}" --no_local_rank "${ARGS[@]}" \
      || { failed+=("kill"); return; }
  fi
  say "kill: the same command again ($OUT/killed_${N}gpu_rerun.log)"
  run_ranks "$N" "$OUT/killed_${N}gpu_rerun.log" "${ARGS[@]}" || { failed+=("kill:rerun"); return; }
  local at
  at=$(sed -n 's/^resumed from .* at step \([0-9]*\).*/\1/p' "$OUT/killed_${N}gpu_rerun.log" | head -n 1)
  if [ -z "$at" ]; then
    echo "error: the rerun did not resume ($OUT/killed_${N}gpu_rerun.log)" >&2
    failed+=("kill:rerun")
    return
  fi
  say "kill: the rerun resumed at step $at"
  "$PY" -m benchmarks.multigpu losses --reference "$REF" --run "rerun=$dir" --after-step "$at" --rtol "$RTOL" \
    --out "$OUT/kill_rerun.json" || failed+=("kill:report")
}

# route_on NGPU DIR CONFIG: benchmarks/route.sh, each GPU's memory in use sampled meanwhile (DIR.memory.csv)
route_on() {
  local n=$1 dir=$2 config=$3 sampler= rc
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 1000 > "$dir.memory.csv" 2>/dev/null &
    sampler=$!
  fi
  NGPU=$n bash benchmarks/route.sh "$dir" "$config" > "$dir.log" 2>&1
  rc=$?
  [ -z "$sampler" ] || kill "$sampler" 2>/dev/null
  return $rc
}

part_route() {
  local config one=${ROUTE_ONE:-} n extra
  config=$(user_path "${ROUTE_CONFIG:-configs/upcycle/smollm2_route_h200.yaml}")
  if [ -z "$one" ]; then
    one=$OUT/route_1gpu
    say "route on 1 GPU ($one)"
    route_on 1 "$one" "$config" || { failed+=("route:1"); return; }
  else
    one=$(user_path "$one")
  fi
  say "route on $N GPUs ($OUT/route_${N}gpu)"
  route_on "$N" "$OUT/route_${N}gpu" "$config" || { failed+=("route:$N"); return; }
  # the plan at the micro-batches route.sh lowered for N GPUs (its "for N GPUs:" line)
  extra=$(sed -n "s/.*for $N GPUs: //p" "$OUT/route_${N}gpu/route.log" | tail -n 1)
  for n in 1 "$N"; do
    # shellcheck disable=SC2046,SC2086  # the overrides split into words on purpose
    "$PY" -m upcycle.cli plan --config "$config" --gpus "$n" $([ "$n" = "$N" ] && echo $extra) \
      > "$OUT/plan_${n}gpu.txt" 2>&1 || failed+=("route:plan$n")
  done
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.multigpu route --one "$one/route" --many "$OUT/route_${N}gpu/route" --rtol "$RTOL" \
    --memory "$one.memory.csv" "$OUT/route_${N}gpu.memory.csv" --plan-config "$config" --gpus "$N" \
    --plan-override $extra --out "$OUT/route.json" || failed+=("route:report")
  say "route: $OUT/route.json"
}

for part in "${PARTS[@]}"; do
  "part_$part"
done
export_autotune
if [ ${#failed[@]} -gt 0 ]; then
  echo "error: multigpu: failed: ${failed[*]} (their logs in $OUT; rerun the same command to go on)" >&2
  exit 1
fi
say "multigpu: done; reports in $OUT/*.json"
