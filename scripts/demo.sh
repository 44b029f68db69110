#!/usr/bin/env bash
# `make demo`: the TransferEngine between two local processes over shm, beside a plain
# libfabric write loop on the same provider, as a table. Results also go to out/xfer_shm.json.
set -euo pipefail
build=${1:-build}
mkdir -p out
echo "ferry demo: bench xfer over shm (two processes on this host)"
"$build/ferry" bench xfer --provider shm --json out/xfer_shm.json
echo
echo "JSON written to out/xfer_shm.json"
