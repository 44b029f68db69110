#!/usr/bin/env bash
# Profiles one MoE kernel with Nsight Compute on a GPU machine (the device tool) and writes two
# files under $OUT: the summary (with the bench's output) and the per-instruction stall samples
# (SASS with source lines, CSV). The device tool brings back only a few files per call.
# Run after gpu_check.sh has built build-gpu (quick mode is enough: it builds ferry_cli, the
# `ferry` binary with the benchmarks of src/bench/):
#   bash scripts/gpu_profile.sh <kernel regex> <tokens> [extra bench flags]
# One rank, so no kernel waits for a peer and the profile shows the kernel's own cost.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
kernel=${1:?kernel name regex}; tokens=${2:?tokens}; shift 2
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
name=prof_$(echo "$kernel" | tr -c 'a-z0-9' '_')_$tokens
"$ncu" --kernel-name "regex:$kernel" --launch-skip 3 --launch-count 1 --import-source yes \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section SourceCounters \
  -o "/tmp/$name" -f build-gpu/ferry bench moe --backend cuda --ranks 1 --ranks-per-node 1 \
  --hidden 7168 --topk 8 --experts 256 --dtype fp8 --tokens "$tokens" --warmup 2 --iters 4 "$@" \
  > "/tmp/$name.run.txt" 2>&1 || { tail -20 "/tmp/$name.run.txt"; exit 1; }
{ tail -30 "/tmp/$name.run.txt"; "$ncu" --import "/tmp/$name.ncu-rep" --print-summary none; } \
  > "$out/$name.txt" 2>&1
# The source page: every SASS instruction with its source line and warp-stall samples.
"$ncu" --import "/tmp/$name.ncu-rep" --page source --csv --print-source sass \
  > "$out/$name.sass.csv" 2>>"$out/$name.txt"
grep -E "Duration|Warp Cycles Per Issued|Achieved Occupancy|Registers Per" "$out/$name.txt"
wc -l "$out/$name.sass.csv"
