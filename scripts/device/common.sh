# Shared set-up of the device scripts (sourced): carried assets, Triton's autotune cache, and the
# hand-back of logs + autotune results through $OUT (at most 8 files come back).
: "${OUT:?run this on the device machine, where OUT is set}"
export HYBRIDLM_CACHE=/tmp/hybridlm-cache
# fla asks Triton to cache autotune results on disk; a shared folder lets later processes reuse them,
# and the results carried back in .xfer/autotune.tar.xz spare the next machine the minutes of tuning.
export TRITON_CACHE_DIR=/tmp/triton-cache
LOGS=/tmp/device-logs   # raw logs stay here; pack_out bundles them (at most 8 files come back from $OUT)
mkdir -p "$HYBRIDLM_CACHE" "$TRITON_CACHE_DIR" "$LOGS"
# the shards' metadata names tokenizer and sources by their paths on the machine that prepared them
relocate_meta() { sed -i "s#$(cat "$HYBRIDLM_CACHE/cache_root.txt")#$HYBRIDLM_CACHE#g" data_cache/*/meta.json 2>/dev/null; }
# once per machine (later calls to a warm machine reuse it); only with .xfer carried, else the marker would make
# a later call that does carry it skip the unpacking (session 17 lost a call to that)
if [ ! -f "$HYBRIDLM_CACHE/.unpacked" ] && [ -f .xfer/cache.tar.xz ]; then
  tar xJf .xfer/cache.tar.xz -C "$HYBRIDLM_CACHE"
  cp .xfer/cache_root.txt "$HYBRIDLM_CACHE/"  # later calls need not carry .xfer
  [ -f .xfer/data.tar.xz ] && tar xJf .xfer/data.tar.xz
  relocate_meta
  [ -f .xfer/autotune.tar.xz ] && python3 -m hybridlm.training.kernel_cache import .xfer/autotune.tar.xz
  touch "$HYBRIDLM_CACHE/.unpacked"
fi

# the loss-parity mix (scripts/device/pack_mix.sh), carried in a call of its own: 18 MB beside the 58 MB bundle
if [ -f .xfer_mix/mix.tar.xz ] && [ ! -f data_cache/mix-llama3.2/meta.json ]; then
  tar xJf .xfer_mix/mix.tar.xz && relocate_meta
fi

# Call after every phase: a call cut off by its time limit still returns what the finished phases wrote.
pack_out() {
  python3 -m hybridlm.training.kernel_cache export "$OUT/autotune.tar.xz" > /dev/null
  tar czf "$OUT/logs.tar.gz.tmp" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}
finish_device_run() { pack_out; ls -la "$OUT"; }
