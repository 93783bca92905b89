#!/usr/bin/env bash
# The training-speed benchmark (BENCHMARKS.md, "Training throughput") on one GPU of the device machine, one family per process, so that a family cut off by
# its time limit (fla's autotuning costs minutes per mixer on a fresh machine) leaves the others' reports.
#   FAMILIES="gdn mamba2 kda mb16 1b"  which families, in this order
#   DEADLINE_AT=<epoch seconds>   stop launching / cut the running family at that time
#   GPU=1                         which GPU
#   PRECISION=bf16                ours' engine precision (bf16, bf16-mixed, fp32); reports get a _PRECISION suffix
#   MAMBA2_COMPILE=on             Mamba2's SSD inputs through torch.compile (--mamba2-compile-inputs); reports get _compiled
#   CONV_KERNEL=fla               ours' short convs through fla's causal_conv1d (--conv-kernel; default the project's);
#                                 reports get _flaconv
#   CONV_X_ONCE=on                the conv backward's autotuner also offered X_ONCE (--conv-x-once); reports get _xonce
#   NORM_KERNEL=fla               ours' RMSNorms through fla's rms_norm (--norm-kernel; default the project's);
#                                 reports get _flanorm
#   LOSS_KERNEL=fla               ours' LM-head cross-entropy through fla's kernel (--loss-kernel); reports get _flaloss
#   OVERRIDES="k=v ..."           model keys for ours (--model-override), e.g. "fuse_projections=false
#                                 fuse_residual_norm=false" for the step without the training fusions
#   OPTIM_OVERRIDES="k=v ..."     optim keys for ours (--optim-override), e.g. "immediate_grad_update=true"
#   TAG=_suffix                   appended to the report's name (for a run with OVERRIDES / OPTIM_OVERRIDES)
#   TRACE=1                       also a Chrome trace with Python stacks of each entry's profiled steps
#                                 (trace_<entry>.json.gz; python -m hybridlm.bench.trace_gaps reads it)
#   CONFIGS="gdn_300m"            only these of the family's configs; a config may carry overrides of its own, measured
#                                 in the same run: CONFIGS="gdn_300m gdn_300m:optim.step_on_device=true"
#   PEERS=""                      these peers instead of the family's (empty: none)
# Reports: $LOGS/speed_<family>/train_speed.{json,png} (+ profile_<entry>.json); join them with --merge.
set -u
cd "$(dirname "$0")/../.."
source scripts/device/common.sh
declare -A FAMILY=(
  [gdn]="--configs gdn_300m gdn_300m_hybrid --peers fla_gdn fla_gdn+late --micro-batch 64"   # +late: the target's peer
  [mamba2]="--configs mamba2_300m mamba2_300m_hybrid gdn_300m gdn_300m_hybrid --peers --micro-batch 64"   # with GDN: both 0.9x ratios in one run
  [kda]="--configs kda_300m --peers fla_kda fla_kda+late --micro-batch 64"
  [mb16]="--configs gdn_300m --peers llama fla_gdn --micro-batch 16"   # the Llama peer keeps full logits: 64 cannot fit
  [1b]="--configs gdn_1b --peers --micro-batch 16"
)
for fam in ${FAMILIES:-gdn mamba2 kda mb16 1b}; do
  left=$(( ${DEADLINE_AT:-$((EPOCHSECONDS + 540))} - EPOCHSECONDS ))
  [ "$left" -lt 30 ] && { echo "train_speed: no time left for $fam"; break; }
  echo "[$(date +%T)] train_speed $fam (${left}s left)"
  tag=$fam${PRECISION:+_$PRECISION}$([ "${MAMBA2_COMPILE:-off}" = on ] && echo _compiled)$([ "${CONV_KERNEL:-project}" = fla ] && echo _flaconv)$([ "${CONV_X_ONCE:-off}" = on ] && echo _xonce)$([ "${NORM_KERNEL:-project}" = fla ] && echo _flanorm)$([ "${LOSS_KERNEL:-project}" = fla ] && echo _flaloss)${TAG:-}
  CUDA_VISIBLE_DEVICES=${GPU:-1} timeout "$left" python3 -m pretrain.train_speed --out "$LOGS/speed_$tag" \
    --keep-going --data data_cache/janeausten-llama3.2 --seq 2048 --steps ${STEPS:-10} --warmup 3 --profile ${PROFILE:-3} \
    --precision "${PRECISION:-bf16}" --mamba2-compile-inputs "${MAMBA2_COMPILE:-off}" \
    --conv-kernel "${CONV_KERNEL:-project}" --conv-x-once "${CONV_X_ONCE:-off}" --norm-kernel "${NORM_KERNEL:-project}" \
    --loss-kernel "${LOSS_KERNEL:-project}" ${OVERRIDES:+--model-override $OVERRIDES} \
    ${OPTIM_OVERRIDES:+--optim-override $OPTIM_OVERRIDES} $([ "${TRACE:-0}" = 1 ] && echo --trace) \
    ${FAMILY[$fam]} ${CONFIGS:+--configs $CONFIGS} ${PEERS+--peers $PEERS} > "$LOGS/speed_$tag.log" 2>&1
  echo "[$(date +%T)] train_speed $tag: exit $?"
  grep -E "tok/s|tokens/s|OOM|Error|first step" "$LOGS/speed_$tag.log" | tail -n 8
  pack_out
done
