#!/usr/bin/env bash
# Resolve the set-up's install (torch from constraints.txt, then the toolkit with its test extra, all under
# constraints.txt), and the serving extra beside the toolkit at that torch, against the public package index
# alone, as a stock machine would: this machine's pip configuration, local wheel folders and PIP_* variables are
# ignored. Installs nothing; exits non-zero on a conflict. Needs the package index, and ~1.5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=$(grep -E '^torch==' constraints.txt)
REPORT=$(mktemp)
trap 'rm -f "$REPORT"' EXIT
# PIP_CONFIG_FILE=/dev/null: pip loads no configuration file at all (site, global or user)
env -i PATH="$PATH" HOME="$HOME" PIP_CONFIG_FILE=/dev/null \
    "$PY" -m pip install --dry-run --ignore-installed --disable-pip-version-check -q --report "$REPORT" \
    -c constraints.txt "$TORCH" -e ".[test]"
summary() {
"$PY" - "$REPORT" "$1" <<'PY'
import json, sys
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
print(f"check_resolution: {sys.argv[2]}: {len(got)} packages resolve from the public index with no conflict "
      f"(torch {got.get('torch')}, triton {got.get('triton')}, deepspeed {got.get('deepspeed')}, "
      f"transformers {got.get('transformers')}, vllm {got.get('vllm')})")
PY
}
summary "the set-up"
# the serving extra (vLLM's CUDA build) beside the toolkit, at the set-up's torch
env -i PATH="$PATH" HOME="$HOME" PIP_CONFIG_FILE=/dev/null \
    "$PY" -m pip install --dry-run --ignore-installed --disable-pip-version-check -q --report "$REPORT" \
    "$TORCH" -e ".[serve]"
summary "the serving extra"
