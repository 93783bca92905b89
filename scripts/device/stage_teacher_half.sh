#!/usr/bin/env bash
# Move one carried half of the teacher wheel (and whatever else .xfer_a/.xfer_b hold) to /tmp/xfer, where
# it outlives the next call's carry on the same warm machine. Fails loudly on a fresh machine.
set -eu
cd "$(dirname "$0")/../.."
[ -f /tmp/site/.ready ] || { echo "fresh machine: the bundle from the first call is gone"; exit 3; }
mkdir -p /tmp/xfer && cp -v "$1"/* /tmp/xfer/ && ls -la /tmp/xfer
