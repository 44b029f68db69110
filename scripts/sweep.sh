#!/usr/bin/env bash
# Push-vs-pull sweep: for each mode, starts the serving stack, runs `ferry bench serve` over
# QPS x input length, writes <mode>_qps<q>_in<in>_out<out>_iter<i>.json, then plots.
# Everything it starts is stopped at the end, on Ctrl-C too.
#
# The stack is three processes: `ferry serve prefill`, `ferry serve decode` (KV over the
# libfabric connector, provider shm unless -P says otherwise) and `ferry serve router`.
# Compute is modelled; KV bytes and their transfers are real.
#
#   scripts/sweep.sh [-b BUILD_DIR] [-o OUT_DIR] [-m "push pull pull-inline"] [-q "1 2 4 8"]
#                    [-i "1024 4096 16384"] [-O 128] [-n PROMPTS] [-r ITERATIONS] [-v]
#                    [-p ROUTER_PORT] [-P PROVIDER]
#                    [-- extra flags for the engines, e.g. --model tiny --tp 1]
set -euo pipefail

build=build
out=sweep-results
modes="push pull pull-inline"
qps_list="1 2 4 8"
inputs="1024 4096 16384"
output_len=128
prompts=20
iters=1
verify=()
port=18000
provider=shm
while getopts "b:o:m:q:i:O:n:r:vp:P:" opt; do
    case $opt in
        b) build=$OPTARG ;;
        o) out=$OPTARG ;;
        m) modes=$OPTARG ;;
        q) qps_list=$OPTARG ;;
        i) inputs=$OPTARG ;;
        O) output_len=$OPTARG ;;
        n) prompts=$OPTARG ;;
        r) iters=$OPTARG ;;
        v) verify=(--verify) ;;
        p) port=$OPTARG ;;
        P) provider=$OPTARG ;;
        *) sed -n 2,14p "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
engine_flags=("$@")
ferry="$build/ferry"
[[ -x $ferry ]] || { echo "error: $ferry not found; build first (make build)" >&2; exit 1; }
mkdir -p "$out"

healthy() {  # python3 is there already for the plots; curl may not be
    /usr/bin/python3 -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" \
        "http://127.0.0.1:$1/health" >/dev/null 2>&1
}

pids=()
stop_server() {
    local pid
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

# Bench flags that must match the engines (model shape for vocabulary and verification).
bench_model=()
for ((k = 0; k < ${#engine_flags[@]}; k++)); do
    case ${engine_flags[$k]} in
        --model|--tp) bench_model+=("${engine_flags[$k]}" "${engine_flags[$((k + 1))]}") ;;
    esac
done

for mode in $modes; do
    log="$out/server_${mode}.log"
    : >"$log"
    kv=(--kv-mode "$mode" --provider "$provider")
    "$ferry" serve prefill --port $((port + 1)) "${kv[@]}" "${engine_flags[@]}" >>"$log" 2>&1 &
    pids+=($!)
    "$ferry" serve decode --port $((port + 2)) "${kv[@]}" "${engine_flags[@]}" >>"$log" 2>&1 &
    pids+=($!)
    "$ferry" serve router --port "$port" --mode "$mode" --prefill "127.0.0.1:$((port + 1))" \
        --decode "127.0.0.1:$((port + 2))" >>"$log" 2>&1 &
    pids+=($!)
    for p in $((port + 1)) $((port + 2)) "$port"; do
        for _ in $(seq 1 300); do
            healthy "$p" && break
            for pid in "${pids[@]}"; do
                kill -0 "$pid" 2>/dev/null || { echo "error: a server died, see $log" >&2; exit 1; }
            done
            sleep 0.1
        done
        healthy "$p" || { echo "error: server on $p not up after 30 s, see $log" >&2; exit 1; }
    done
    for in_len in $inputs; do
        for qps in $qps_list; do
            for ((it = 0; it < iters; it++)); do
                name="${mode}_qps${qps}_in${in_len}_out${output_len}_iter${it}.json"
                echo "== $name" >&2
                rc=0
                "$ferry" bench serve --port "$port" --label "$mode" --request-rate "$qps" \
                    --num-prompts "$prompts" --input-len "$in_len" --output-len "$output_len" \
                    --seed "$it" "${verify[@]}" "${bench_model[@]}" \
                    --result-file "$out/$name" >/dev/null || rc=$?
                # The bench catches Ctrl-C itself (and says so with 130), so bash may not.
                if ((rc == 130)); then rm -f "$out/$name"; exit 130; fi  # partial run
            done
        done
    done
    stop_server
done

/usr/bin/python3 "$(dirname "$0")/plot_sweep.py" "$out" --out "$out/sweep.png"
