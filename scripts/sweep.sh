#!/usr/bin/env bash
# Push-vs-pull sweep: for each mode, starts the serving stack, runs `ferry bench serve` over
# QPS x input length, writes <mode>_qps<q>_in<in>_out<out>_iter<i>.json, then plots.
# Everything it starts is stopped at the end, on Ctrl-C too.
#
# Until the libfabric KV connector is wired into `ferry serve prefill|decode`, the stack is
# `ferry serve local` (both engines and the router in one process, KV copied between pools).
# Compute is modelled; KV bytes and their transfers are real.
#
#   scripts/sweep.sh [-b BUILD_DIR] [-o OUT_DIR] [-m "push pull pull-inline"] [-q "1 2 4 8"]
#                    [-i "1024 4096 16384"] [-O 128] [-n PROMPTS] [-r ITERATIONS] [-v]
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
while getopts "b:o:m:q:i:O:n:r:vp:" opt; do
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
        *) sed -n 2,13p "$0"; exit 2 ;;
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

server_pid=""
stop_server() {
    if [[ -n $server_pid ]]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
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
    "$ferry" serve local --mode "$mode" --port "$port" --prefill-port $((port + 1)) \
        --decode-port $((port + 2)) "${engine_flags[@]}" >"$log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 300); do
        healthy "$port" && break
        kill -0 "$server_pid" 2>/dev/null || { echo "error: server died, see $log" >&2; exit 1; }
        sleep 0.1
    done
    healthy "$port" ||
        { echo "error: server not up after 30 s, see $log" >&2; exit 1; }
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
