#!/usr/bin/env bash
# Copy HEAD plus the named working-tree files into .snap/ (ignored, carried): a device call then runs code
# that is not being edited at that moment (helpers may be mid-change in the working tree).
#   bash scripts/device/snapshot.sh FILE...      (files relative to the repo root)
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.snap/" .git/info/exclude || echo /.snap/ >> .git/info/exclude
rm -rf .snap && mkdir .snap && git archive HEAD | tar x -C .snap
for f in "$@"; do mkdir -p ".snap/$(dirname "$f")" && cp "$f" ".snap/$f"; done
du -sh .snap
