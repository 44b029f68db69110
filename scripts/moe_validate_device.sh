#!/usr/bin/env bash
# Issue 36: the runs that scripts/moe_model.py --validate sets its model against, on one quiet
# machine in one go, then the model beside them. Writes every run's JSON and text under
# $OUT/moe_validate (or ./out/moe_validate) and prints predicted beside measured last.
#
#   bash scripts/moe_validate_device.sh [path/to/ferry]
#
# Run by scripts/gpu_check.sh with FERRY_GPU_MOE_VALIDATE=1 (after the build, ferry at
# build-gpu/ferry); it runs anywhere ferry is built: without a GPU the CUDA rows are skipped.
#   CPU backend (`--backend cpu`), shm and tcp, EP2/4/8 as 2x1, 2x2 and 2x4 ranks per node, at
#     the decode shape (128 tokens) and FERRY_MOE_VALIDATE_CPU_PREFILL tokens (default 1024:
#     4096 takes seconds a layer on the CPU), with one rank alone at each shape and `bench
#     xfer` per provider as the model's inputs;
#   the proxied CUDA path (`--backend cuda --floor`, every rank on GPU 0, other nodes through
#     the host proxy), tcp and shm, EP2/4/8 as 2x1, 2x2, 4x2, at 128 and 4096 tokens.
# Each run has its own timeout; one that fails is reported and the rest go on. Runs left when
# FERRY_MOE_VALIDATE_BUDGET_S (default 330) seconds have passed are skipped, in the order
# below (most wanted first). FERRY_MOE_VALIDATE_ITERS scales the iteration counts (default 1;
# 0.1 for a quick rehearsal).
set -uo pipefail
ferry=${1:-build-gpu/ferry}
out=${OUT:-out}/moe_validate
mkdir -p "$out"
budget=${FERRY_MOE_VALIDATE_BUDGET_S:-330}
scale=${FERRY_MOE_VALIDATE_ITERS:-1}
cpu_prefill=${FERRY_MOE_VALIDATE_CPU_PREFILL:-1024}
start=$SECONDS
status=0
log() { echo "[moe_validate $(date +%H:%M:%S) +$((SECONDS - start))s] $*" | tee -a "$out/log.txt"; }

if [ ! -x "$ferry" ]; then
  log "no ferry binary at $ferry"
  exit 2
fi
py=$(command -v python3 || true)
gpus=0
command -v nvidia-smi > /dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# Physical cores too: the CPU model's open question is how ranks share them (docs/MOE.md).
phys=$(lscpu -p=core,socket 2>/dev/null | grep -v '^#' | sort -u | wc -l)
echo "{\"cores\": $(nproc), \"physical_cores\": ${phys:-0}, \"gpus\": $gpus}" > "$out/host.json"
log "ferry $ferry; $(nproc) cores, $gpus GPU(s); budget ${budget}s, iterations x$scale"

iters() { awk -v n="$1" -v s="$scale" 'BEGIN { v = int(n * s + 0.5); print (v < 1 ? 1 : v) }'; }

# run NAME TIMEOUT ARGS...: one `ferry ...` run, its JSON to $out/NAME.json, text to NAME.txt.
run() {
  local name=$1 limit=$2
  shift 2
  if [ $((SECONDS - start)) -ge "$budget" ]; then
    log "skip $name: budget of ${budget}s spent"
    return 0
  fi
  local t0=$SECONDS
  timeout "$limit" "$ferry" "$@" --json "$out/$name.json" > "$out/$name.txt" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    rm -f "$out/$name.json"  # a half-written run must not reach the model
    local why="exit $rc"
    [ $rc -eq 124 ] && why="over ${limit}s"
    log "FAILED $name ($why, $((SECONDS - t0))s): ferry $*"
    tail -5 "$out/$name.txt" | sed 's/^/    /'
  else
    # The layer's p50 row, the floor line, or bench xfer's latency line.
    local got
    got=$(grep -E '^layer |^floor: write|write\+imm latency' "$out/$name.txt" | tr -s ' ' \
      | cut -c1-120 | tr '\n' ' ')
    log "$name ($((SECONDS - t0))s): $got"
  fi
}

shape=(--hidden 7168 --topk 8 --experts 256 --dtype fp8)

# The fabric figures the CPU model takes: CPU per 64 B write, per 4 MiB write, latency.
for prov in shm tcp; do
  run "xfer_$prov" 90 bench xfer --provider "$prov" --sizes 4194304 --seconds 0.2 \
    --no-yardsticks --repeat 1
done

# The proxied CUDA path (every rank on GPU 0; EP2/4/8 as 2x1, 2x2, 4x2 as the H100 runs of
# 2026-12-06/07), tcp and shm: cuda_runs TOKENS WARMUP ITERS.
cuda_runs() {
  if [ "$gpus" -lt 1 ]; then
    log "no GPU: the proxied CUDA runs at $1 tokens are skipped"
    return 0
  fi
  for prov in tcp shm; do
    for nr in "2 1" "4 2" "8 2"; do
      read -r n r <<< "$nr"
      run "cuda_${prov}_ep${n}_t$1" 120 bench moe --backend cuda "${shape[@]}" \
        --provider "$prov" --ranks "$n" --ranks-per-node "$r" --tokens "$1" --floor \
        --warmup "$2" --iters "$3"
    done
  done
}
cuda_runs 128 "$(iters 5)" "$(iters 50)"

# The CPU backend: one rank alone at each shape (the model's CPU costs), then EP2/4/8.
for t in 128 "$cpu_prefill"; do
  if [ "$t" = 128 ]; then w=$(iters 3) i=$(iters 20); else w=1 i=$(iters 6); fi
  run "cpu_one_t$t" 90 bench moe --backend cpu "${shape[@]}" --ranks 1 --ranks-per-node 1 \
    --tokens "$t" --warmup "$w" --iters "$i"
  for prov in shm tcp; do
    for nr in "2 1" "4 2" "8 4"; do
      read -r n r <<< "$nr"
      run "cpu_${prov}_ep${n}_t$t" 90 bench moe --backend cpu "${shape[@]}" --provider "$prov" \
        --ranks "$n" --ranks-per-node "$r" --tokens "$t" --warmup "$w" --iters "$i"
    done
  done
done

# The prefill shape through the proxy last (EP2 over shm ran on an H200 on 2026-12-03).
cuda_runs 4096 2 "$(iters 10)"

log "runs done in $((SECONDS - start))s; the model beside them:"
if [ -z "$py" ]; then
  log "no python3: run python3 scripts/moe_model.py --validate --measured $out elsewhere"
  exit 1
fi
"$py" scripts/moe_model.py --validate --measured "$out" 2>&1 | tee "$out/model.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
log "done (status $status)"
exit $status
