#!/usr/bin/env bash
# `make demo`: two parts, both on this host over the shm provider.
#  1. The TransferEngine between two processes beside a plain libfabric write loop (a table;
#     JSON in out/xfer_shm.json).
#  2. Disaggregated serving: `ferry serve prefill` + `ferry serve decode` + `ferry serve router`
#     as separate processes, KV moving through the libfabric connector, a short push vs pull vs
#     pull-inline sweep with `ferry bench serve --verify`; prints a table and writes plots
#     (out/serve-sweep/sweep.png). Compute is modelled (Qwen3-32B on H200, TP 8); KV bytes and
#     their transfers are real.
# Everything started is stopped at the end, on Ctrl-C too (scripts/sweep.sh owns the servers).
#
#   scripts/demo.sh [BUILD_DIR]     DEMO_QPS, DEMO_INPUTS, DEMO_PROMPTS override the sweep
set -euo pipefail
build=${1:-build}
here=$(dirname "$0")
mkdir -p out
trap 'echo "demo interrupted" >&2; exit 130' INT TERM

echo "== 1/2 ferry bench xfer over shm (two processes on this host)"
"$build/ferry" bench xfer --provider shm --seconds 0.2 --json out/xfer_shm.json
echo "JSON written to out/xfer_shm.json"
echo

qps=${DEMO_QPS:-"2 8"}
inputs=${DEMO_INPUTS:-"1024 4096"}
prompts=${DEMO_PROMPTS:-16}
echo "== 2/2 serving sweep: push, pull, pull-inline x QPS {$qps} x input {$inputs}, output 32,"
echo "   $prompts prompts per point, every token verified (compute modelled, KV transfers real)"
rm -rf out/serve-sweep
# In the background so that a TERM to this script reaches the sweep too (Ctrl-C reaches the
# whole process group anyway); the sweep's own trap stops the servers it started.
bash "$here/sweep.sh" -b "$build" -o out/serve-sweep -m "push pull pull-inline" -q "$qps" \
    -i "$inputs" -O 32 -n "$prompts" -v -p 18000 &
sweep=$!
trap 'kill -TERM "$sweep" 2>/dev/null; wait "$sweep" 2>/dev/null; echo "demo interrupted" >&2; exit 130' INT TERM
wait "$sweep"
echo
echo "results: out/serve-sweep/*.json, plot: out/serve-sweep/sweep.png"
