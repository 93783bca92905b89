# Shared by the benchmark scripts (sourced, never run by itself): the repository root as the working directory,
# the Python that has the toolkit, the output folder, the checks made before any work starts, Triton's cache,
# data preparation and DeepSpeed's launcher.
#
# Settings every script reads (environment):
#   PYTHON=/path/to/python  the interpreter with the toolkit installed (default: the first of python3 on PATH and
#                           the repository's .venv/bin/python, made by scripts/setup.sh, that has it)
#   CUDA_VISIBLE_DEVICES    the GPUs a script may use, as CUDA reads it (default: all of them)
#   TRITON_CACHE_DIR=DIR    Triton's compiled kernels and autotune results (default: OUT_DIR/triton-cache, empty on
#                           a new OUT_DIR: the first training step then includes the autotuning, the cold start)
#   AUTOTUNE_IMPORT=FILE    autotune results of an earlier run (its OUT_DIR/autotune.tar.xz) imported before
#                           anything runs: the first step compiles the winners only
#   HYBRIDLM_CACHE=DIR      the asset cache (tokenizer, corpora, record files, teacher; default ~/.cache/hybridlm)
#   MASTER_PORT=29500       the rendezvous port of multi-GPU runs
#   HYBRIDLM_NVLS=0         NVLink multicast (NVLS) for multi-GPU runs: 0 (default) launches the ranks with
#                           NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1, for hosts
#                           whose GPUs other jobs share; 1 leaves the libraries' defaults (multicast on where the
#                           host has it), for a host of your own. Any of the three variables you set yourself is
#                           kept as you set it (hybridlm.engine.init_distributed applies the same defaults to a
#                           rank launched without these scripts)
set -u
BENCH_CWD=$PWD  # where the script was started: the user's relative paths are relative to it
BENCH_SCRIPT=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
BENCH_NAME=benchmarks/$(basename "$0")
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT" || exit 2
export PYTHONUNBUFFERED=1

# user_path P: a path the user gave, relative to where the script was started when it exists there, else to the
# checkout (the defaults, e.g. data_cache/... and configs/...)
user_path() {
  case "$1" in
    /*|"") echo "$1" ;;
    *) if [ -e "$BENCH_CWD/$1" ]; then echo "$BENCH_CWD/$1"; else echo "$1"; fi ;;
  esac
}

say() { echo "[$(date +%T)] $*"; }
fail() { echo "error: $*" >&2; exit 2; }

# the header comment of the running script, without its leading '# '
bench_usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$BENCH_SCRIPT"; }

# bench_start USAGE_LINE "$@": --help, the output folder (first argument), the Python, the CUDA check.
# Sets OUT (absolute), PY, GPUS (the visible GPUs' ids, as CUDA_VISIBLE_DEVICES names them).
bench_start() {
  local usage_line=$1; shift
  case "${1:-}" in
    -h|--help) bench_usage; exit 0 ;;
    "") fail "missing OUT_DIR; usage: $usage_line (--help for the settings)" ;;
    -*) fail "unknown option $1; usage: $usage_line (--help for the settings)" ;;
  esac
  local candidates=() c
  if [ -n "${PYTHON:-}" ]; then candidates=("$PYTHON")
  else
    c=$(command -v python3 || command -v python || true)
    [ -n "$c" ] && candidates+=("$c")
    [ -x "$REPO_ROOT/.venv/bin/python" ] && candidates+=("$REPO_ROOT/.venv/bin/python")
  fi
  PY=
  for c in "${candidates[@]}"; do
    # installed (its metadata) with its dependencies (found, not imported: quick)
    if "$c" -c "import importlib.metadata as m, importlib.util as u, sys; m.version('hybrid-lm-toolkit');
sys.exit(not all(u.find_spec(n) for n in ('torch', 'transformers', 'deepspeed', 'fla')))" 2>/dev/null; then
      PY=$c; break
    fi
  done
  [ -n "$PY" ] || fail "no Python with the toolkit installed (tried: ${candidates[*]:-none}); run 'pip install -e .' or 'bash scripts/setup.sh' in $REPO_ROOT, or set PYTHON"
  local cuda
  cuda=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__)" 2>/dev/null) \
    || fail "$PY cannot import torch"
  [ "${cuda%% *}" -gt 0 ] || fail "$BENCH_NAME needs a CUDA GPU: torch.cuda.is_available() is False (torch ${cuda#* }, $PY)"
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a GPUS <<< "$CUDA_VISIBLE_DEVICES"
  else mapfile -t GPUS < <(seq 0 $(( ${cuda%% *} - 1 ))); fi
  local dir=$1
  [ "${dir#/}" != "$dir" ] || dir=$BENCH_CWD/$dir
  mkdir -p "$dir" || fail "cannot create $1"
  OUT=$(cd "$dir" && pwd)
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT/triton-cache}
  [ "${TRITON_CACHE_DIR#/}" != "$TRITON_CACHE_DIR" ] || TRITON_CACHE_DIR=$BENCH_CWD/$TRITON_CACHE_DIR
  export TRITON_CACHE_DIR
  mkdir -p "$TRITON_CACHE_DIR"
  if [ -n "${AUTOTUNE_IMPORT:-}" ]; then
    AUTOTUNE_IMPORT=$(user_path "$AUTOTUNE_IMPORT")
    "$PY" -m hybridlm.training.kernel_cache import "$AUTOTUNE_IMPORT" || fail "AUTOTUNE_IMPORT=$AUTOTUNE_IMPORT: not imported"
  fi
}

# the script's own output also into OUT/NAME.log
bench_log() { exec > >(tee -a "$OUT/$1") 2>&1; }

# Triton's autotune results into OUT/autotune.tar.xz (AUTOTUNE_IMPORT on the next host spares its tuning)
export_autotune() {
  "$PY" -m hybridlm.training.kernel_cache export "$OUT/autotune.tar.xz" > /dev/null 2>&1 \
    && say "autotune results: $OUT/autotune.tar.xz"
}

# prepare_data DIR: packed shards for the two data sets the benchmarks use, when DIR has none; another DIR must
# hold prepared shards already (python -m pretrain.prepare, or hybrid-prepare)
prepare_data() {
  local dir=$1 src
  [ -f "$dir/meta.json" ] && return 0
  case "$(basename "$dir")" in
    janeausten-llama3.2) src=(--sources asset:janeausten) ;;
    mix-llama3.2) src=(--mix configs/data/upcycle_mix.yaml --val-fraction 0.02 --num-proc "${NUM_PROC:-4}") ;;
    *) fail "DATA=$dir holds no prepared shards (no meta.json); prepare it with 'python -m pretrain.prepare ... --out $dir'" ;;
  esac
  say "preparing $dir: python -m pretrain.prepare ${src[*]} --tokenizer asset:llama3.2"
  "$PY" -m pretrain.prepare "${src[@]}" --tokenizer asset:llama3.2 --out "$dir" --quiet \
    || fail "could not prepare $dir (above); without network, carry the assets in (benchmarks/README.md, 'Air-gapped host')"
}

# multicast_env: NVLink multicast off for the ranks about to be launched, unless HYBRIDLM_NVLS=1 (see the
# settings above); a variable the user exported keeps its value
multicast_env() {
  case "${HYBRIDLM_NVLS:-0}" in
    1) return 0 ;;
    0) ;;
    *) fail "HYBRIDLM_NVLS=$HYBRIDLM_NVLS: expected 0 (multicast off, the default) or 1 (the libraries' defaults)" ;;
  esac
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-0}
  export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST-1}
  export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS-1}
}

# launch N ARGS...: ARGS (a script, or --module NAME, and its arguments) through DeepSpeed's launcher, one process
# on each of the first N visible GPUs. --no_local_rank: each rank reads LOCAL_RANK from its environment
# (hybridlm.engine.init_distributed); a --local_rank argument would land before a CLI's subcommand (upcycle run).
# NVLink multicast off unless HYBRIDLM_NVLS=1 (multicast_env)
launch() {
  local n=$1; shift
  [ "$n" -le "${#GPUS[@]}" ] || fail "NGPU=$n, but only ${#GPUS[@]} GPUs are visible (CUDA_VISIBLE_DEVICES)"
  local ids
  ids=$(IFS=,; echo "${GPUS[*]:0:$n}")
  multicast_env
  # the launcher takes the GPUs from CUDA_VISIBLE_DEVICES when given no --num_gpus / --include
  CUDA_VISIBLE_DEVICES=$ids "$PY" -m deepspeed.launcher.runner --master_port "${MASTER_PORT:-29500}" --no_local_rank "$@"
}
