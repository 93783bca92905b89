#!/usr/bin/env bash
# Training throughput (BENCHMARKS.md, "Training throughput"; with PROFILE / TRACE "Training step breakdown"; the
# peak memory of each entry, "Memory"; the first step on an empty Triton cache, "Cold start"): our pre-training
# step (python -m benchmarks.train_speed: the engine, loader and loop of pretrain.py) against peers of the same
# shapes in a plain PyTorch loop, one process per family, on the first visible GPU.
#
#   bash benchmarks/train_speed.sh OUT_DIR [FAMILY ...]
#
# Families (default: all five, in this order):
#   gdn     gdn_300m, gdn_300m_hybrid against fla_gdn and fla_gdn+late (the target's peer), micro-batch 64
#   mamba2  mamba2_300m, mamba2_300m_hybrid, gdn_300m, gdn_300m_hybrid (both Mamba2 / GDN ratios in one run), 64
#   kda     kda_300m against fla_kda and fla_kda+late, micro-batch 64
#   mb16    gdn_300m against llama and fla_gdn, micro-batch 16 (the Llama peer keeps full logits: 64 does not fit)
#   1b      gdn_1b, micro-batch 16
# Writes per family OUT_DIR/speed_<family>/train_speed.{json,png} (+ profile_<entry>.json, trace_<entry>.json.gz)
# and its output in OUT_DIR/speed_<family>.log; this script's summary in OUT_DIR/train_speed.log; Triton's autotune
# results in OUT_DIR/autotune.tar.xz. Join reports with
# python -m benchmarks.train_speed --merge A.json B.json --out DIR.
# Data: DATA (default data_cache/janeausten-llama3.2, prepared from Jane Austen's novels with Llama-3.2's
# tokenizer when missing).
#
# Settings (environment; a setting that changes ours adds a suffix to the report's folder, speed_<family><suffix>):
#   PRECISION=bf16             ours' engine precision: bf16, bf16-mixed or fp32 (suffix _<precision> when set)
#   MAMBA2_COMPILE=on          Mamba2's SSD inputs through torch.compile (--mamba2-compile-inputs; _compiled)
#   CONV_KERNEL=fla            ours' short convs through fla's causal_conv1d (--conv-kernel; _flaconv)
#   CONV_X_ONCE=on             the conv backward's autotuner also offered X_ONCE (--conv-x-once; _xonce)
#   NORM_KERNEL=fla            ours' RMSNorms through fla's rms_norm (--norm-kernel; _flanorm)
#   LOSS_KERNEL=fla            ours' LM-head cross-entropy through fla's kernel (--loss-kernel; _flaloss)
#   OVERRIDES="k=v ..."        model keys for ours and the peers' shapes (--model-override), e.g. "num_layers=6"
#   RUNTIME_OVERRIDES="k=v ..." runtime keys for ours (--runtime-override), e.g. "fuse_projections=false
#                              fuse_residual_norm=false" for the step without the training fusions
#   OPTIM_OVERRIDES="k=v ..."  optim keys for ours (--optim-override), e.g. "immediate_grad_update=true"
#   TAG=_suffix                appended to the report's folder name (for a run with any of the three above)
#   CONFIGS="gdn_300m"         only these of ours; a config may carry overrides of its own, measured in the same
#                              run: CONFIGS="gdn_300m gdn_300m:optim.step_on_device=true"
#   PEERS="fla_gdn"            these peers instead of the family's (PEERS= , empty: none)
#   STEPS=10 WARMUP=3          measured steps (median) and steps before them (the first autotunes)
#   PROFILE=3                  steps under torch.profiler after the measured ones: kernel time by category and
#                              GEMM time by shape (profile_<entry>.json; 0: none)
#   TRACE=1                    also a Chrome trace with Python stacks of the profiled steps (trace_<entry>.json.gz;
#                              python -m benchmarks.harness.trace_gaps reads it)
#   SEQ=2048                   tokens per sequence
#   PEAK_TFLOPS=989.5          the GPU's dense bf16 peak for MFU (H100 SXM and H200: 989.5; A100: 312)
#   NGPU=N                     then ours again (peers run in one process only) data-parallel on the first N visible
#                              GPUs through DeepSpeed's launcher, into speed_<family>_<N>gpu/ with each entry's
#                              tokens/s ratio to the one-GPU report
#   and those of benchmarks/common.sh (PYTHON, CUDA_VISIBLE_DEVICES, TRITON_CACHE_DIR, AUTOTUNE_IMPORT, ...)
source "$(dirname "$0")/common.sh"
bench_start "bash benchmarks/train_speed.sh OUT_DIR [gdn|mamba2|kda|mb16|1b ...]" "$@"
shift
declare -A FAMILY=(
  [gdn]="--configs gdn_300m gdn_300m_hybrid --peers fla_gdn fla_gdn+late --micro-batch 64"
  [mamba2]="--configs mamba2_300m mamba2_300m_hybrid gdn_300m gdn_300m_hybrid --peers --micro-batch 64"
  [kda]="--configs kda_300m --peers fla_kda fla_kda+late --micro-batch 64"
  [mb16]="--configs gdn_300m --peers llama fla_gdn --micro-batch 16"
  [1b]="--configs gdn_1b --peers --micro-batch 16"
)
FAMILIES=("$@")
[ ${#FAMILIES[@]} -gt 0 ] || FAMILIES=(gdn mamba2 kda mb16 1b)
for fam in "${FAMILIES[@]}"; do
  [ -n "${FAMILY[$fam]+x}" ] || fail "unknown family '$fam' (expected: gdn mamba2 kda mb16 1b)"
done
NGPU=${NGPU:-1}
[[ $NGPU =~ ^[1-9][0-9]*$ ]] || fail "NGPU=$NGPU: expected a GPU count"
[ "$NGPU" -le "${#GPUS[@]}" ] || fail "NGPU=$NGPU, but only ${#GPUS[@]} GPUs are visible (CUDA_VISIBLE_DEVICES)"
bench_log train_speed.log
DATA=$(user_path "${DATA:-data_cache/janeausten-llama3.2}")
prepare_data "$DATA"
say "train_speed: families ${FAMILIES[*]} on GPU ${GPUS[0]}$([ "$NGPU" -gt 1 ] && echo ", then ours on $NGPU GPUs"); $PY"

speed_args() {  # the arguments every run of one family shares
  echo --data "$DATA" --seq "${SEQ:-2048}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --profile "${PROFILE:-3}" \
    --peak-tflops "${PEAK_TFLOPS:-989.5}" --precision "${PRECISION:-bf16}" \
    --mamba2-compile-inputs "${MAMBA2_COMPILE:-off}" --conv-kernel "${CONV_KERNEL:-project}" \
    --conv-x-once "${CONV_X_ONCE:-off}" --norm-kernel "${NORM_KERNEL:-project}" --loss-kernel "${LOSS_KERNEL:-project}" \
    ${OVERRIDES:+--model-override $OVERRIDES} ${OPTIM_OVERRIDES:+--optim-override $OPTIM_OVERRIDES} \
    ${RUNTIME_OVERRIDES:+--runtime-override $RUNTIME_OVERRIDES} \
    $([ "${TRACE:-0}" = 1 ] && echo --trace)
}
failed=()
for fam in "${FAMILIES[@]}"; do
  tag=$fam${PRECISION:+_$PRECISION}$([ "${MAMBA2_COMPILE:-off}" = on ] && echo _compiled)$([ "${CONV_KERNEL:-project}" = fla ] && echo _flaconv)$([ "${CONV_X_ONCE:-off}" = on ] && echo _xonce)$([ "${NORM_KERNEL:-project}" = fla ] && echo _flanorm)$([ "${LOSS_KERNEL:-project}" = fla ] && echo _flaloss)${TAG:-}
  say "train_speed $tag"
  # shellcheck disable=SC2046  # speed_args and the family's arguments split into words on purpose
  CUDA_VISIBLE_DEVICES=${GPUS[0]} "$PY" -m benchmarks.train_speed --out "$OUT/speed_$tag" --keep-going $(speed_args) \
    ${FAMILY[$fam]} ${CONFIGS:+--configs $CONFIGS} ${PEERS+--peers $PEERS} > "$OUT/speed_$tag.log" 2>&1
  rc=$?
  say "train_speed $tag: exit $rc ($OUT/speed_$tag.log)"
  [ $rc -eq 0 ] || failed+=("$tag")
  grep -E "tok/s|tokens/s|OOM|Error|first step" "$OUT/speed_$tag.log" | tail -n 8
  if [ "$NGPU" -gt 1 ]; then
    compare=()
    [ -f "$OUT/speed_$tag/train_speed.json" ] && compare=(--compare-to "$OUT/speed_$tag/train_speed.json")
    say "train_speed $tag on $NGPU GPUs"
    # shellcheck disable=SC2046
    launch "$NGPU" --module benchmarks.train_speed --out "$OUT/speed_${tag}_${NGPU}gpu" $(speed_args) ${FAMILY[$fam]} \
      ${CONFIGS:+--configs $CONFIGS} --peers "${compare[@]}" > "$OUT/speed_${tag}_${NGPU}gpu.log" 2>&1
    rc=$?
    say "train_speed $tag on $NGPU GPUs: exit $rc ($OUT/speed_${tag}_${NGPU}gpu.log)"
    [ $rc -eq 0 ] || failed+=("${tag}_${NGPU}gpu")
    grep -E "tok/s|tokens/s|OOM|Error|ratio" "$OUT/speed_${tag}_${NGPU}gpu.log" | tail -n 8
  fi
done
export_autotune
[ ${#failed[@]} -eq 0 ] || { echo "error: train_speed: failed: ${failed[*]} (their logs in $OUT)" >&2; exit 1; }
say "train_speed: done; reports in $OUT/speed_*/"
