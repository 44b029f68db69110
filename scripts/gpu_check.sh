#!/usr/bin/env bash
# Builds ferry on a GPU machine, runs the GPU tests and benchmarks, and writes logs and JSON
# under $OUT (or ./out). Used through the device tool on the lent H200 machines, which have
# the libfabric runtime but not always its headers: pass a folder holding include/rdma (from
# Debian's libfabric-dev) as FERRY_FABRIC_HEADERS to build against those.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$out/gpu_check.log"; }

log "host: $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tr '\n' ';')"
nvidia-smi topo -m > "$out/topo.txt" 2>&1 || true

# libfabric: system pkg-config if present, else the carried headers + the system runtime.
if ! pkg-config --exists libfabric 2>/dev/null; then
  hdr=${FERRY_FABRIC_HEADERS:-.carry/libfabric}
  lib=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
  if [ -z "$lib" ] || [ ! -d "$hdr/include/rdma" ]; then
    log "libfabric headers or runtime missing (runtime: '${lib}', headers: $hdr)"; exit 2
  fi
  mkdir -p /tmp/ferry-fabric/lib/pkgconfig
  ln -sf "$lib" /tmp/ferry-fabric/lib/libfabric.so
  cat > /tmp/ferry-fabric/lib/pkgconfig/libfabric.pc <<PC
Name: libfabric
Description: libfabric (runtime from the system, headers carried)
Version: 1.17.0
Cflags: -I$(realpath "$hdr/include")
Libs: -L/tmp/ferry-fabric/lib -lfabric
PC
  export PKG_CONFIG_PATH=/tmp/ferry-fabric/lib/pkgconfig:${PKG_CONFIG_PATH:-}
  log "using carried libfabric headers with $lib"
fi

# OpenSSL's libcrypto (the deployment secret's HMAC): CMakeLists.txt falls back to the carried
# headers in .carry/openssl; the carried library serves where the runtime is missing too.
if ! ldconfig -p | grep -q 'libcrypto\.so\.3 ' && [ -d .carry/openssl/lib ]; then
  export LD_LIBRARY_PATH=$PWD/.carry/openssl/lib:${LD_LIBRARY_PATH:-}
  log "using the carried libcrypto"
fi

# hwloc (the topology): likewise, .carry/hwloc where the machine has none.
if ! ldconfig -p | grep -q 'libhwloc\.so\.15 ' && [ -d .carry/hwloc/lib ]; then
  export LD_LIBRARY_PATH=$PWD/.carry/hwloc/lib:${LD_LIBRARY_PATH:-}
  log "using the carried libhwloc"
fi

# The serving stack needs cpp-httplib, which the lent machines lack: leave it out there.
serve_flag=
if ! pkg-config --exists cpp-httplib 2>/dev/null; then
  serve_flag=-DFERRY_BUILD_SERVE=OFF
  log "no cpp-httplib: building without the serving stack (FERRY_BUILD_SERVE=OFF)"
fi
# Exported: scripts/gpu_pip_check.sh passes the same flags to `pip install .`.
export FERRY_CMAKE_FLAGS="$serve_flag ${FERRY_CMAKE_FLAGS:-}"

build=build-gpu
log "configure"
cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release ${FERRY_CMAKE_FLAGS:-} > "$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 3; }
grep -E "CUDA support" "$out/configure.log" | tee -a "$out/gpu_check.log"
log "build"
# FERRY_GPU_QUICK=1: only the targets in FERRY_GPU_TARGETS (default: the ferry tool, target
# ferry_cli; target ferry is the library alone, without the benchmarks of src/bench/), no
# tests and no transfer benchmarks, straight to FERRY_GPU_EXTRA (a quick look at one thing).
targets=()
[ -n "${FERRY_GPU_QUICK:-}" ] && targets=(--target ${FERRY_GPU_TARGETS:-ferry_cli})
cmake --build $build -j "$(nproc)" "${targets[@]}" > "$out/build.log" 2>&1 || { grep -E "error|Error" -A3 "$out/build.log" | head -60; exit 4; }
status=0
# Issue 36 (FERRY_GPU_MOE_VALIDATE=1): the CPU backend and the proxied CUDA path over shm and
# tcp at EP2/4/8, then scripts/moe_model.py beside them (about 6 minutes, first, on a quiet
# machine; with FERRY_GPU_QUICK=1 only this and FERRY_GPU_EXTRA run). Files under
# $out/moe_validate.
if [ -n "${FERRY_GPU_MOE_VALIDATE:-}" ]; then
  log "moe model validation (scripts/moe_validate_device.sh)"
  OUT=$out bash scripts/moe_validate_device.sh $build/ferry || status=1
fi
# Issue 37 (FERRY_GPU_PEERS=1): ferry beside its peers on this host, `python3 -m
# ferry.bench_peers --transports $FERRY_GPU_PEERS_TRANSPORTS` (default cuda: GPU to GPU; add
# shm,tcp,shm-cma-wait for the host transports on a host of 16 cores; build target
# ferry_python, so with FERRY_GPU_QUICK=1 set FERRY_GPU_TARGETS to include it). The machines
# reach no package index: the peers' wheels for their Python come in .whl* folders (pip download
# --no-deps --python-version 3.12 ...: nixl==1.5.1 nixl-cu13==1.5.1, 59 MB, and
# mooncake-transfer-engine-non-cuda==0.3.13.post1, 46 MB, each carried alone) and are installed
# into $build/peers, which stays between calls on a warm machine: a first call may install one
# (FERRY_GPU_PEERS=install: install only), the next the other and run. Peers not installed are
# skipped.
if [ -n "${FERRY_GPU_PEERS:-}" ]; then
  if ls .whl*/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target $build/peers .whl*/*.whl >> "$out/peers_pip.txt" 2>&1 || status=1
  fi
  if [ "$FERRY_GPU_PEERS" != install ]; then
    transports=${FERRY_GPU_PEERS_TRANSPORTS:-cuda}
    log "bench_peers --transports $transports"
    PYTHONPATH=$build/python:$build/peers timeout "${FERRY_GPU_PEERS_TIMEOUT:-400}" python3 -m \
      ferry.bench_peers --transports "$transports" --rounds "${FERRY_GPU_PEERS_ROUNDS:-10}" \
      --json "$out/peers.json" > "$out/peers.txt" 2>&1 || status=1
    grep -v " of .* so far" "$out/peers.txt" | tail -80
  fi
fi
if [ -n "${FERRY_GPU_QUICK:-}" ]; then
  log "extra: ${FERRY_GPU_EXTRA:-}"
  bash -c "${FERRY_GPU_EXTRA:-true}" 2>&1 | tee "$out/extra.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=$rc
  log "done (status $status)"
  exit "$status"
fi

log "GPU tests"
for t in $build/tests/*_tests; do
  timeout "${FERRY_GPU_TEST_TIMEOUT:-240}" "$t" --gtest_filter='*Gpu*:*gpu*:*Cuda*:*cuda*' > "$out/$(basename "$t").log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$out/$(basename "$t").log" | sed "s|^|$(basename "$t"): |" | tee -a "$out/gpu_check.log"
  # The first lines of what went wrong, so a failure can be read from the console alone.
  grep -E "Failure|error|Error" "$out/$(basename "$t").log" | head -12 | cut -c1-400
done

if [ -n "${FERRY_GPU_TESTS:-}" ]; then
  log "tests: $FERRY_GPU_TESTS"
  for t in $build/tests/*_tests; do
    "$t" --gtest_filter="$FERRY_GPU_TESTS" > "$out/all_$(basename "$t").log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) " "$out/all_$(basename "$t").log" | sed "s|^|$(basename "$t"): |" | tee -a "$out/gpu_check.log"
  done
fi

# The Python package's CUDA tensor tests (two processes on one GPU through CUDA IPC), run
# against the package `pip install .` builds for this machine's python3 and its torch.
OUT=$out bash scripts/gpu_pip_check.sh || status=1

log "bench gpu"
$build/ferry bench gpu --json "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.txt" || status=1

# KV push and pull between the GPUs (prefill's pool on GPU 0, decode's on GPU 1; the same GPU
# when there is one), Qwen3-32B's per-rank shape at TP 8.
kv="--gpu --layers 64 --kv-heads 1 --head-dim 128 --block-size 16 --iters 10"
log "bench kv --gpu"
timeout 120 $build/ferry bench kv $kv --mode push --tokens 1024,4096,16384 \
  --json "$out/bench_kv_gpu_push.json" 2>&1 | tail -5 | tee "$out/bench_kv_gpu.txt" || status=1
timeout 120 $build/ferry bench kv $kv --mode push --tokens 16384 --random-blocks 2>&1 | tail -1 \
  | tee -a "$out/bench_kv_gpu.txt" || status=1
timeout 120 $build/ferry bench kv $kv --mode pull --tokens 16384 2>&1 | tail -1 \
  | tee -a "$out/bench_kv_gpu.txt" || status=1

# MoE all-to-all on the GPUs (FERRY_GPU_MOE=1): ferry's kernels at the decode and prefill
# shapes, then NCCL all_to_all_single on the same bytes, in the same run.
if [ -n "${FERRY_GPU_MOE:-}" ]; then
  moe="--backend cuda --ranks 2 --hidden 7168 --topk 8 --experts 256 --dtype fp8"
  for t in 128 4096; do
    log "bench moe cuda, $t tokens"
    timeout 120 $build/ferry bench moe $moe --tokens $t --warmup 20 --iters 200 \
      --json "$out/bench_moe_cuda_$t.json" 2>&1 | tee "$out/bench_moe_cuda_$t.txt" || status=1
    # NCCL refuses two ranks on one GPU.
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      log "nccl all_to_all, $t tokens"
      timeout 180 python3 scripts/nccl_alltoall.py --ranks 2 --tokens $t --iters 200 \
        --json "$out/nccl_alltoall_$t.json" 2>&1 | tee "$out/nccl_alltoall_$t.txt" || status=1
    fi
  done
  # The same decode layer from Python (ferry.moe over torch tensors), in the same run.
  if ls $build/python/ferry/_ferry*.so > /dev/null 2>&1; then
    py=$(sed -n 's/^Python3_EXECUTABLE:[A-Z]*=//p' $build/CMakeCache.txt); py=${py:-python3}
    log "python ferry.bench_moe cuda, 128 tokens"
    PYTHONPATH=$build/python timeout 180 "$py" -m ferry.bench_moe --backend cuda --ranks 2 \
      --tokens 128 --dtype fp8 --out-dtype bf16 --warmup 20 --iters 200 \
      --json "$out/bench_moe_python_128.json" 2>&1 | tee "$out/bench_moe_python_128.txt" || status=1
  fi
  log "bench moe cuda, 128 tokens, graph replay"
  timeout 120 $build/ferry bench moe $moe --tokens 128 --warmup 20 --iters 200 --graph \
    --json "$out/bench_moe_cuda_128_graph.json" 2>&1 | tee "$out/bench_moe_cuda_128_graph.txt" \
    || status=1
  # Receive kernels launched while the send kernels run (one rank per GPU only), and where
  # a call spends its time (kernel stamps).
  timeout 120 $build/ferry bench moe $moe --tokens 128 --warmup 20 --iters 200 --graph \
    --early-launch 2>&1 | grep -E "^layer" | sed 's/^/early launch: /' | tee -a "$out/bench_moe_cuda_128_graph.txt"
  timeout 120 $build/ferry bench moe $moe --tokens 128 --warmup 20 --iters 100 --trace 2>&1 \
    | tee "$out/bench_moe_cuda_128_trace.txt" || status=1
  # Per-rank partials: a quarter of the combine bytes at 2 ranks (docs/MOE.md).
  for t in 128 4096; do
    log "bench moe cuda, $t tokens, per-rank combine"
    timeout 120 $build/ferry bench moe $moe --tokens $t --warmup 20 --iters 200 --combine per-rank \
      2>&1 | tee "$out/bench_moe_cuda_${t}_per_rank.txt" || status=1
  done
  timeout 120 $build/ferry bench moe $moe --tokens 128 --warmup 20 --iters 200 --graph \
    --combine per-rank 2>&1 | grep -E "^layer" | sed 's/^/per-rank graph: /' \
    | tee -a "$out/bench_moe_cuda_128_graph.txt"
  # Ranks of other nodes through the host proxy over shm, against the floor measured in the
  # same run (a plain write loop for each rank's remote bytes plus the mapped layer):
  # EP2 as 2 nodes x 1, EP4 as 2 x 2, EP8 as 4 x 2 (issue 17 part 2).
  proxied="--backend cuda --hidden 7168 --topk 8 --experts 256 --dtype fp8 --provider shm"
  for rn in "2 1" "4 2" "8 2"; do
    set -- $rn
    log "bench moe cuda proxied, EP$1, $2 rank(s) per node, 128 tokens"
    timeout 180 $build/ferry bench moe $proxied --ranks $1 --ranks-per-node $2 --tokens 128 \
      --warmup 10 --iters 100 --floor 2>&1 | tee "$out/bench_moe_proxied_ep$1.txt" || status=1
  done
fi

# The engine's host path against a raw fi_write loop on this host's cores (issue 18).
if [ -n "${FERRY_GPU_XFER:-}" ]; then
  log "bench xfer shm, message rate"
  timeout 120 $build/ferry bench xfer --provider shm --repeat 3 --seconds 0.2 --rate 2>&1 \
    | tee "$out/bench_xfer_shm.txt" || status=1
fi

if [ -n "${FERRY_GPU_EXTRA:-}" ]; then
  log "extra: $FERRY_GPU_EXTRA"
  bash -c "$FERRY_GPU_EXTRA" 2>&1 | tee "$out/extra.txt" || status=1
fi
log "done (status $status)"
exit $status
