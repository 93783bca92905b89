#!/usr/bin/env bash
# GPU checks for the model, pre-training and speed issues, in one device call on a 2-GPU H200 machine:
#   GPU 0: the Triton-vs-torch test module, one process per (sublayer, dtype) so that fla's Triton
#          autotuning (minutes per mixer on a fresh machine) compiles in parallel on the CPUs, next to the
#          whole-model and generation GPU tests; then the per-mixer timing table;
#          GENERATION=1: then scripts/device/generation.sh (TEACHER=twin without the teacher's wheel;
#          GEN_GPUS="0 1" also gives it GPU 1 for the teacher, when SPEED is off);
#   GPU 1: PRETRAIN=1: `deepspeed pretrain.py` on the GDN-300M recipe on 1, then 2 GPUs (ZeRO-1, nccl);
#          SPEED=1: scripts/device/train_speed.sh (the training-speed benchmark, FAMILIES) instead;
#   both:  TWO_GPU=1: at the end, the training-speed benchmark of gdn_300m on 2 GPUs against the 1-GPU report.
# Settings: KINDS (sublayers to check; "" for none), MODEL_TESTS=1 (whole-model + generation GPU tests; MODEL_TESTS_K narrows them: a pytest -k expression), TIMING_KINDS (mixers to time; "" for none), PRETUNE=1
# (warm the autotune cache for the upcycling route's shapes), DEADLINE (seconds until the logs must be packed).
# Needs .device (the bundle) and .xfer (made by scripts/device/pack_data.sh). Results land in $OUT.
set -u
cd "$(dirname "$0")/../.."
source .device/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
source scripts/device/common.sh
START=$SECONDS
export DEADLINE_AT=$(( EPOCHSECONDS + ${DEADLINE:-540} ))
stamp() { echo "[$((SECONDS - START))s] $*"; }
left() { local l=$(( DEADLINE_AT - EPOCHSECONDS )); echo $(( l > 1 ? l : 1 )); }  # seconds left before the logs must be packed (timeout 0 would mean none)

export HYBRIDLM_PARITY_LOG=$LOGS/parity.jsonl
stamp "sublayer parity tests: ${KINDS-gdn kda mamba2 mla mlp}"
PARITY_PIDS=()
for kind in ${KINDS-gdn kda mamba2 mla mlp}; do
  for dtype in float32 bfloat16; do
    CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 -m pytest -q -m gpu -o addopts= tests/gpu \
      -k "sublayer and $kind and $dtype" > "$LOGS/pytest_${kind}_${dtype}.log" 2>&1 &
    PARITY_PIDS+=($!)
  done
done
if [ "${MODEL_TESTS:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 -m pytest -q -rfE --tb=line -m gpu -o addopts= tests/gpu -k "${MODEL_TESTS_K:-whole_model or generation}" \
    > "$LOGS/pytest_model_generation.log" 2>&1 &
  PARITY_PIDS+=($!)
fi

# warm the autotune cache for the SmolLM2 hybrid of the upcycling route, which a later call on this machine runs
[ "${PRETUNE:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=0 timeout 400 python3 scripts/device/pretune_route.py .xfer/smollm2_config.json \
  > "$LOGS/pretune_route.log" 2>&1 &

if [ "${SPEED:-0}" = 1 ]; then
  GPU=1 DEADLINE_AT=$(( DEADLINE_AT - ${TWO_GPU_S:-0} )) bash scripts/device/train_speed.sh > "$LOGS/train_speed.log" 2>&1 &
fi
if [ "${PRETRAIN:-1}" = 1 ]; then
  PRETRAIN_ARGS=(--config configs/experiments/gdn_300m.yaml data.path=data_cache/janeausten-llama3.2
    optim.micro_batch_size=16 optim.global_batch_size=32 optim.max_steps=30 optim.warmup_steps=5
    run.eval_interval=15 run.save_interval=15 run.log_interval=1 data.val_max_batches=2 run.sample_tokens=16)
  stamp "pretrain on 1 GPU"
  CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) < 240 ? $(left) : 240 )) deepspeed --master_port 29511 --num_gpus 1 pretrain.py "${PRETRAIN_ARGS[@]}" \
    run.output_dir=/tmp/runs/gdn_1gpu > "$LOGS/pretrain_1gpu.log" 2>&1
  stamp "pretrain on 1 GPU: exit $?"; pack_out
  timeout $(( $(left) < 200 ? $(left) : 200 )) deepspeed --master_port 29512 --num_gpus 2 pretrain.py "${PRETRAIN_ARGS[@]}" \
    run.output_dir=/tmp/runs/gdn_2gpu > "$LOGS/pretrain_2gpu.log" 2>&1
  stamp "pretrain on 2 GPUs: exit $?"; pack_out
  cp /tmp/runs/gdn_1gpu/metrics.jsonl "$LOGS/metrics_1gpu.jsonl" 2>/dev/null
  cp /tmp/runs/gdn_2gpu/metrics.jsonl "$LOGS/metrics_2gpu.jsonl" 2>/dev/null
fi

[ ${#PARITY_PIDS[@]} -gt 0 ] && wait "${PARITY_PIDS[@]}"
stamp "parity and model / generation tests done"; pack_out
grep -h -E "passed|failed|error" "$LOGS"/pytest_*.log
if [ -n "${TIMING_KINDS-gdn kda mamba2 mla mlp}" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 -m hybridlm.bench.mixers --out "$OUT/mixers.json" --dtypes \
    --kinds ${TIMING_KINDS-gdn kda mamba2 mla mlp} > "$LOGS/bench_mixers.log" 2>&1
  stamp "mixer timing: exit $?"; pack_out
fi
if [ "${GENERATION:-0}" = 1 ]; then
  # leave TWO_GPU_S seconds of the deadline to the 2-GPU phase
  GPUS=${GEN_GPUS:-0} DEADLINE_AT=$(( DEADLINE_AT - ${TWO_GPU_S:-0} )) bash scripts/device/generation.sh > "$LOGS/generation.log" 2>&1
  stamp "generation: exit $?"
fi
wait
stamp "one-GPU phases done"
if [ "${TWO_GPU:-0}" = 1 ] && [ "$(left)" -gt 90 ] && [ -f "$LOGS/speed_gdn/train_speed.json" ]; then
  timeout $(left) python3 -m torch.distributed.run --nproc_per_node 2 -m pretrain.train_speed --out "$LOGS/speed_2gpu" \
    --data data_cache/janeausten-llama3.2 --seq 2048 --micro-batch 64 --steps 10 --warmup 3 --configs gdn_300m --peers \
    --compare-to "$LOGS/speed_gdn/train_speed.json" > "$LOGS/speed_2gpu.log" 2>&1
  stamp "2-GPU train_speed: exit $?"
fi
stamp "all done"
grep -h "tok/s" "$LOGS"/speed_*.log "$LOGS"/generation_*.log 2>/dev/null
tail -n 15 "$LOGS/pytest_model_generation.log" 2>/dev/null
finish_device_run
