#!/usr/bin/env bash
# Loss parity against flash-linear-attention's models (python -m hybridlm.bench.loss_parity) at the 300M shapes:
# GDN-300M vs fla GatedDeltaNetForCausalLM, KDA-300M vs fla KDAForCausalLM, Mamba2 (the Mamba2-300M dims, one
# Mamba2 mixer per sublayer: the peers' Mamba2 blocks have no MLP) vs transformers' Mamba2ForCausalLM; micro-batch 8, seq 2048,
# 300 steps, lr 6e-4 -> 6e-5 (warmup 30, cosine), bf16 autocast over fp32 weights, the route's varied English
# mix tokenized with Llama-3.2's tokenizer (carry .xfer_mix from scripts/device/pack_mix.sh in the call after the
# bundle's; without it, the Jane Austen shards of .xfer). Each family is one process on its own GPU lane, so a family cut off by its
# time limit leaves the others' reports (the JSON is rewritten after every run; a missing chart is redrawn
# here with `python -m hybridlm.bench.loss_parity --replot --out DIR`).
# Settings:
#   FAMILIES="gdn kda mamba2"   which families ("hybrid": gdn_300m_hybrid against gdn_300m, both ours)
#   GPUS="0 1"                  lanes: family i runs on GPU GPUS[i % n], the families of one lane in turn
#   SEEDS="0 1"                 peer seeds (their spread is the yardstick); ours runs with the first
#   ABLATION=1                  also ours with other inits, whole and part by part (the ablation table):
#                               gdn / kda: fla's weights (peer) and the previous init (legacy = the conv weights);
#                               mamba2: the previous conv (fla's: legacy:mamba2_conv_fla), transformers' weights
#                               (peer); transformers' A_log and unscaled out_proj were measured (sessions 11-12)
#   PEER_NORM=grouped           mamba2: the transformers peer's gated norm, grouped as mamba_ssm and ours (default)
#                               or d_inner (transformers before 5.24: the device's 5.17 computes that by itself)
#   OURS_INIT="fla legacy:conv" explicit variants instead (overrides ABLATION); the default is "fla peer": ours
#                               from its own init and from the peer's exact initial weights (a gap that the peer
#                               run closes is the initialisation, one it keeps is everything else)
#   ENGINE="bf16"               also ours through the training engine at these precisions (pretrain.py's path)
#   STEPS_<family>=1000         that family's steps (default STEPS)
#   SPLIT=1                     ours and the peer as two processes at once on the family's GPU (--only ours / --only
#                               peer into parity_<family>_{ours,peer}/, joined by --merge into parity_<family>/)
#   RESUME=1                    keep the finished runs of an earlier call's report in $LOGS (the same settings) and
#                               run only the missing ones: a family cut off by the call's limit continues in the next
#   STEPS=300 MB=8 SEQ=2048 VAL_INTERVAL=25 VAL_BATCHES=8 MAMBA2_CHUNK=64 (the peers' naive torch SSD without
#   mamba_ssm: its transient [b, T, chunk, heads, d_state] fp32 products are ~8.6 GB at chunk 64, mb 8)
#   DEADLINE=<seconds> (default 560): when the logs must be packed
# Needs .device (the bundle) and .xfer (scripts/device/pack_data.sh). Reports: $LOGS/parity_<family>/.
# Measured in session 8 (one H200, BENCHMARKS.md "Loss parity"): a 300-step run of a 300M GDN / KDA model at
# 16k tokens per step takes 40-60 s once fla's kernels are tuned (the first KDA run ~130-200 s with autotuning),
# so one call fits one family with two peer seeds and three runs of ours; 1000 steps take ~2.5 min a run.
# transformers' Mamba2 peer runs its SSD through fla's chunk_simple_gla (--peer-ssd chunked, the default, checked
# against its reference SSD before training): 0.34 s a step at 300M (session 10), ~5 s with its reference SSD.
set -u
cd "$(dirname "$0")/../.."
source .device/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
source scripts/device/common.sh
export DEADLINE_AT=$(( EPOCHSECONDS + ${DEADLINE:-560} ))
declare -A CONFIG=([gdn]=gdn_300m [kda]=kda_300m [mamba2]=mamba2_300m)
declare -A ABLATE=([gdn]="fla peer legacy" [kda]="fla peer legacy"
                   [mamba2]="fla legacy:mamba2_conv_fla peer")
# fla's Mamba2 without mamba_ssm wires B / C groups to heads in another order than ours (hybridlm/bench/
# peer_weights.py): with mamba2_300m's 8 groups of 4 heads it is not the same model, transformers' Mamba2 is
declare -A PEER=([gdn]=fla [kda]=fla [mamba2]=hf [hybrid]=ours)
# "hybrid": the 75 % GDN hybrid against pure GDN-300M (both ours), the same recipe and batches, one plot
CONFIG[hybrid]=gdn_300m_hybrid
declare -A FAMILY_ARG=([hybrid]=gdn)
declare -A EXTRA=([hybrid]="--peer-config gdn_300m")

run_family() {  # family gpu
  local fam=$1 gpu=$2 left=$(( DEADLINE_AT - EPOCHSECONDS - 15 )) steps_var=STEPS_$1
  [ "$left" -lt 30 ] && { echo "loss_parity: no time left for $fam"; return; }
  local init=${OURS_INIT:-fla peer}
  [ -z "${OURS_INIT:-}" ] && [ "${ABLATION:-0}" = 1 ] && init=${ABLATE[$fam]}
  [ -z "${OURS_INIT:-}" ] && [ "$fam" = hybrid ] && init=fla  # both sides are ours: nothing to copy
  echo "[$(date +%T)] loss_parity $fam on GPU $gpu (${left}s left; ours init: $init${SPLIT:+; ours and peer at once})"
  parity() {  # out-dir [--only side]
    CUDA_VISIBLE_DEVICES=$gpu timeout "$left" python3 -m hybridlm.bench.loss_parity --family "${FAMILY_ARG[$fam]:-$fam}" \
      --config "${CONFIG[$fam]}" --out "$1" --data "$DATA" \
      --steps "${!steps_var:-${STEPS:-300}}" $([ "${RESUME:-0}" = 1 ] && echo --resume) --micro-batch "${MB:-8}" --seq "${SEQ:-2048}" --lr 6e-4 --min-lr 6e-5 --warmup 30 \
      ${ENGINE:+--ours-engine $ENGINE} ${EXTRA[$fam]:-} --val-interval "${VAL_INTERVAL:-25}" --val-batches "${VAL_BATCHES:-8}" --log-interval 25 \
      --peer "${PEER[$fam]}" $([ "${PEER[$fam]}" = hf ] && echo --peer-norm "${PEER_NORM:-grouped}") --seeds ${SEEDS:-0 1} --ours-init $init --peer-chunk-size "${MAMBA2_CHUNK:-64}" "${@:2}" \
      >> "$1.log" 2>&1
  }
  if [ -n "${SPLIT:-}" ]; then  # two processes on the GPU (each side's small steps leave it idle half the time)
    parity "$LOGS/parity_${fam}_ours" --only ours & parity "$LOGS/parity_${fam}_peer" --only peer & wait
    python3 -m hybridlm.bench.loss_parity --merge "$LOGS/parity_${fam}_ours/loss_parity.json" \
      "$LOGS/parity_${fam}_peer/loss_parity.json" --out "$LOGS/parity_$fam" > "$LOGS/parity_$fam.log" 2>&1
  else
    parity "$LOGS/parity_$fam"
  fi
  echo "[$(date +%T)] loss_parity $fam: exit $?"
  [ -f "$LOGS/parity_$fam/loss_parity.png" ] || python3 -m hybridlm.bench.loss_parity --replot \
    --out "$LOGS/parity_$fam" > /dev/null 2>&1
  cat "$LOGS/parity_$fam"*.log | grep -E "params|val loss after|Error|error" | tail -n 8
}

DATA=data_cache/mix-llama3.2
[ -f "$DATA/meta.json" ] || DATA=data_cache/janeausten-llama3.2
read -r -a gpus <<< "${GPUS:-0 1}"
read -r -a fams <<< "${FAMILIES:-gdn kda mamba2}"
for lane in "${!gpus[@]}"; do
  (
    for i in "${!fams[@]}"; do
      [ $(( i % ${#gpus[@]} )) -eq "$lane" ] && run_family "${fams[$i]}" "${gpus[$lane]}"
    done
  ) &
done
wait
finish_device_run
