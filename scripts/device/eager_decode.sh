#!/usr/bin/env bash
# Eager decoding after a change to its host-side cost, in one call on a 2-GPU machine:
#   GPU 0: the GPU tests of cached generation (every mixer, fp32 / bf16, padding, CUDA graphs) and TESTS_K more;
#   GPU 1: scripts/device/decode_probe.py at batch 1 / prompt 1k and batch 48 / prompt 8k, then the eager pass
#          of the generation benchmark (generation.sh, PASSES=hybrid_eager) at BATCHES x PROMPT_LENS.
set -u
cd "$(dirname "$0")/../.."
source .device/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
source scripts/device/common.sh
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -rfE --tb=line -m gpu -o addopts= tests/gpu \
  -k "generation${TESTS_K:+ or ($TESTS_K)}" > "$LOGS/pytest_gpu.log" 2>&1 &
TESTS=$!
for shape in "1 1024" "48 8192"; do
  set -- $shape
  CUDA_VISIBLE_DEVICES=1 timeout 120 python3 scripts/device/decode_probe.py .xfer/smollm2_config.json \
    --batch "$1" --prompt "$2" > "$LOGS/decode_probe_b$1_p$2.txt" 2>&1
  head -n 1 "$LOGS/decode_probe_b$1_p$2.txt"
done
pack_out
GPUS=1 PASSES=hybrid_eager TEACHER=twin BATCHES="${BATCHES:-1 48}" PROMPT_LENS="${PROMPT_LENS:-8192}" \
  DEADLINE_AT=$(( EPOCHSECONDS + ${GEN_S:-200} )) bash scripts/device/generation.sh > "$LOGS/generation.log" 2>&1
wait "$TESTS"
tail -n 4 "$LOGS/pytest_gpu.log"
grep -h "tok/s" "$LOGS"/generation_*.log
finish_device_run
