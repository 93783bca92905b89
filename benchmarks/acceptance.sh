#!/usr/bin/env bash
# The acceptance run (BENCHMARKS.md, "Acceptance"): the first command on a new GPU host, and where a contributor with a
# GPU starts. On one CUDA GPU, with the shipped kernel tuning (hybridlm/ops/tuned/), in order:
#   pretrain    `deepspeed pretrain.py` on the GDN-300M recipe, 30 steps at micro-batch 16 (Jane Austen's novels,
#               prepared with Llama-3.2's tokenizer when missing): the first optimizer step's seconds
#   route       every stage of `upcycle run` (init, ILD, SMART, compose, KD, DPO, report) two steps each in bf16 on a
#               random-weight twin of SmolLM2-135M's layers with Llama-3.2's tokenizer: nothing is fetched
#   generate    the generate() fast-path matrix (tests/test_generate_fast_path.py) on CUDA: tokens, scores, random
#               state and warnings against transformers' own loop
#   gpu_tests   every `gpu`-marked test: Triton paths against torch paths of every sublayer and the whole model, the
#               project's kernels, KD's chunk kernel, the fused training step, cached generation and CUDA graphs
#
#   bash benchmarks/acceptance.sh OUT_DIR
#
# Writes OUT_DIR/acceptance.json (schema hybridlm-acceptance/1: passed, seconds per part, the first step's seconds,
# versions, GPU, commit, the shipped tuning's status; rewritten after every part), OUT_DIR/summary.txt (the one-screen
# summary it also prints), OUT_DIR/<part>.log, OUT_DIR/{generate,gpu_tests}.xml (JUnit) and OUT_DIR/autotune.tar.xz.
# Exits 0 when every part passed, 1 otherwise, 2 when it cannot start (no CUDA GPU, no toolkit).
#
# Settings (environment):
#   PARTS="pretrain route"  only these parts, in the order above
#   DATA=DIR                the pre-training part's prepared shards (default data_cache/janeausten-llama3.2)
#   HYBRIDLM_RECORD_TUNING=FILE.jsonl  also record every launch that had to be tuned (kernel_cache make turns it
#                           into a tuning file for this GPU: python -m hybridlm.training.kernel_cache --help)
#   and those of benchmarks/common.sh (PYTHON, CUDA_VISIBLE_DEVICES, TRITON_CACHE_DIR, HYBRIDLM_CACHE, ...)
source "$(dirname "$0")/common.sh"
bench_start "bash benchmarks/acceptance.sh OUT_DIR" "$@"
[ $# -le 1 ] || fail "unexpected arguments after OUT_DIR: ${*:2} (--help)"
# shellcheck disable=SC2206  # PARTS splits into words on purpose
SELECTED=(${PARTS:-pretrain route generate gpu_tests})
for p in "${SELECTED[@]}"; do
  case "$p" in pretrain|route|generate|gpu_tests) ;; *) fail "PARTS: unknown part '$p' (pretrain route generate gpu_tests)" ;; esac
done
"$PY" -c "import pytest, pytest_timeout" 2>/dev/null || fail "pytest and pytest-timeout are not installed for $PY: pip install -e '.[test]'"
DATA=$(user_path "${DATA:-data_cache/janeausten-llama3.2}")
[[ " ${SELECTED[*]} " == *" pretrain "* ]] && prepare_data "$DATA"
TUNING=$("$PY" -c "
import torch
from hybridlm.ops.tuning import apply_shipped_tuning
print(apply_shipped_tuning(quiet=True).line)" 2>&1 | tail -n 1)
say "acceptance: ${SELECTED[*]} on GPU ${GPUS[0]} into $OUT; $TUNING"
CUDA_VISIBLE_DEVICES=${GPUS[0]} "$PY" -m benchmarks.acceptance --out "$OUT" --data "$DATA" --tuning "$TUNING" \
  --parts "${SELECTED[@]}"
rc=$?
export_autotune
exit $rc
