#!/usr/bin/env bash
# The GPU test suite (BENCHMARKS.md, "Test suites"): every test marked `gpu` (tests/gpu/ and any other gpu-marked
# test under tests/), which the default `pytest` run deselects: the Triton paths against the torch paths of every
# sublayer and the whole model, fp32 and bf16; the project's kernels (conv, norms, loss, latent decode, Mamba2's
# decode step); the fused training step; cached generation, CUDA graphs and generate()'s fast path.
#
#   bash benchmarks/gpu_tests.sh OUT_DIR
#
# Its time on a fresh host is mostly compiling and autotuning at the tests' own shapes: the modules timed alone add up
# to more than 12 minutes (BENCHMARKS.md, "GPU"). benchmarks/acceptance.sh runs each test function once instead
# (benchmarks/acceptance.py GPU_SUBSET, a few minutes).
#
# Runs python -m pytest -m gpu on the first visible GPU, and writes OUT_DIR/gpu_tests.xml (JUnit) and
# OUT_DIR/gpu_tests.log (pytest's output), then prints the summary: the counts and each failed test; Triton's
# autotune results into OUT_DIR/autotune.tar.xz. Exits with pytest's status. Needs the test extra (pip install -e '.[test]'; scripts/setup.sh installs it).
#
# Settings (environment):
#   PYTEST_K="generation"   only the tests this pytest -k expression selects
#   PYTEST_ARGS="-x ..."    more pytest arguments (e.g. --durations=20, -x, --timeout=1800)
#   PRETRAIN=1              then `deepspeed pretrain.py` on the GDN-300M recipe for 30 steps (Jane Austen's
#                           novels, prepared when missing) on one GPU and, with two or more visible, on two (ZeRO-1,
#                           NCCL): OUT_DIR/pretrain_{1,2}gpu.log and their metrics.jsonl
#   and those of benchmarks/common.sh (PYTHON, CUDA_VISIBLE_DEVICES, TRITON_CACHE_DIR, AUTOTUNE_IMPORT, ...)
source "$(dirname "$0")/common.sh"
bench_start "bash benchmarks/gpu_tests.sh OUT_DIR" "$@"
[ $# -le 1 ] || fail "unexpected arguments after OUT_DIR: ${*:2} (pytest arguments go in PYTEST_ARGS; --help)"
"$PY" -c "import pytest, pytest_timeout" 2>/dev/null || fail "pytest and pytest-timeout are not installed for $PY: pip install -e '.[test]'"
# tests/gpu/ and the other test files that mark tests gpu
TARGETS=(tests/gpu)
while IFS= read -r f; do TARGETS+=("$f"); done < <(grep -rlE "mark\.gpu" tests --include="*.py" | grep -v "^tests/gpu/" | sort)
say "gpu_tests: ${TARGETS[*]} on GPU ${GPUS[0]}; $PY"
# -o addopts= clears the default run's "-m 'not gpu and not slow'" (pyproject.toml): every gpu test runs, slow ones too
# shellcheck disable=SC2086  # PYTEST_ARGS splits into words on purpose
CUDA_VISIBLE_DEVICES=${GPUS[0]} "$PY" -m pytest -o addopts= -m gpu -q -rfE --tb=short -p no:cacheprovider \
  --junitxml "$OUT/gpu_tests.xml" ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} "${TARGETS[@]}" > "$OUT/gpu_tests.log" 2>&1
rc=$?
echo "--- gpu tests: exit $rc ($OUT/gpu_tests.log, $OUT/gpu_tests.xml)"
sed -n '/short test summary info/,$p' "$OUT/gpu_tests.log"
grep -qE "short test summary info" "$OUT/gpu_tests.log" || tail -n 3 "$OUT/gpu_tests.log"

if [ "${PRETRAIN:-0}" = 1 ]; then
  DATA=$(user_path "${DATA:-data_cache/janeausten-llama3.2}")
  prepare_data "$DATA"
  ARGS=(--config configs/experiments/gdn_300m.yaml "data.path=$DATA" optim.micro_batch_size=16
        optim.global_batch_size=32 optim.max_steps=30 optim.warmup_steps=5 run.eval_interval=15 run.save_interval=15
        run.log_interval=1 data.val_max_batches=2 run.sample_tokens=16)
  for n in 1 2; do
    [ "$n" -le "${#GPUS[@]}" ] || { echo "--- pretrain on $n GPUs: skipped (${#GPUS[@]} visible)"; continue; }
    rm -rf "$OUT/pretrain_${n}gpu"
    launch "$n" pretrain.py "${ARGS[@]}" "run.output_dir=$OUT/pretrain_${n}gpu" > "$OUT/pretrain_${n}gpu.log" 2>&1
    prc=$?
    echo "--- pretrain on $n GPU(s): exit $prc ($OUT/pretrain_${n}gpu.log, $OUT/pretrain_${n}gpu/metrics.jsonl)"
    grep -v "^\[" "$OUT/pretrain_${n}gpu.log" | tail -n 3
    [ $prc -eq 0 ] || rc=1
  done
fi
export_autotune
exit $rc
