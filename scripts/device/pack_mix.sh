#!/usr/bin/env bash
# The loss-parity data for the device: the route's varied English mix (configs/data/upcycle_mix.yaml, 19.1M
# training tokens) tokenized with Llama-3.2's tokenizer, packed into the ignored, carried .xfer_mix/ (18 MB).
# It cannot travel beside the 58 MiB bundle: carry it in the call after the one that carries .device.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.xfer_mix/" .git/info/exclude || echo "/.xfer_mix/" >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
[ -f data_cache/mix-llama3.2/meta.json ] || $PY -m pretrain.prepare --mix configs/data/upcycle_mix.yaml \
  --tokenizer asset:llama3.2 --out data_cache/mix-llama3.2 --val-fraction 0.02 --num-proc 2
mkdir -p .xfer_mix
tar -cf - data_cache/mix-llama3.2 | xz -T0 -6 > .xfer_mix/mix.tar.xz
du -sh .xfer_mix
