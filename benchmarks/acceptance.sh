#!/usr/bin/env bash
# The acceptance run (BENCHMARKS.md, "Acceptance"): the first command on a new GPU host, and where a contributor with a
# GPU starts. On one CUDA GPU, with the shipped kernel tuning (hybridlm/ops/tuned/), in order, at most 8 minutes on a
# fresh H100 or H200 when the tuning file covers its launches (tests/test_tuning_coverage.py):
#   pretrain    `deepspeed pretrain.py` on the GDN-300M recipe, 20 steps at micro-batch 16 (Jane Austen's novels,
#               prepared with Llama-3.2's tokenizer when missing), one checkpoint: the first optimizer step's seconds
#               (about a minute)
#   route       every stage of `upcycle run` (init, ILD, SMART, compose, KD, DPO, report) two steps each in bf16 on a
#               random-weight twin of SmolLM2-135M's layer shapes, 4 layers deep, with Llama-3.2's tokenizer: nothing
#               is fetched (about a minute)
#   generate    the generate() fast-path matrix (tests/test_generate_fast_path.py) on CUDA: tokens, scores, random
#               state and warnings against transformers' own loop (2-3 minutes)
#   gpu_tests   each `gpu` test function once (benchmarks/acceptance.py GPU_SUBSET: every sublayer kind, kernel and
#               decode path, in bf16 and at the route's and recipes' shapes); every `gpu` test is
#               `bash benchmarks/gpu_tests.sh OUT_DIR`
#
#   bash benchmarks/acceptance.sh OUT_DIR
#
# Writes OUT_DIR/acceptance.json (schema hybridlm-acceptance/1: passed, seconds per part, the first step's seconds,
# versions, GPU, the commit and how it is known, the shipped tuning's status; rewritten after every part),
# OUT_DIR/summary.txt (the one-screen summary it also prints), OUT_DIR/<part>.log, OUT_DIR/{generate,gpu_tests}.xml
# (JUnit) and OUT_DIR/autotune.tar.xz.
# Exits 0 when every part passed, 1 otherwise, 2 when it cannot start (no CUDA GPU, no toolkit).
#
# Settings (environment):
#   PARTS="pretrain route"  only these parts, in the order above
#   DATA=DIR                the pre-training part's prepared shards (default data_cache/janeausten-llama3.2)
#   HYBRIDLM_COMMIT=SHA     the commit of this code, for a copy of a checkout whose git metadata cannot say (default:
#                           git rev-parse HEAD where the tracked files equal HEAD's; otherwise the report says why not)
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
