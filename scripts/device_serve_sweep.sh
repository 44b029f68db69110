#!/usr/bin/env bash
# On a lent GPU machine (device tool, carry [".carry"] filled by
# scripts/prepare_device_carry.sh): builds the serving stack without CUDA against the carried
# cpp-httplib, then runs scripts/sweep.sh once per argument and prints each point's median
# TTFT, TPOT, transfer and decode wait and wait share. The machine has no matplotlib, so there
# is no plot; each sweep's JSON goes to $OUT/sweep_<n>.tgz. Uses the CPUs only.
#
#   bash scripts/device_serve_sweep.sh '-m push -q "1 2 4 8" -i "1024 4096 16384" -O 128 -n 16 -v'
set -u
cd "$(dirname "$0")/.."
h=$PWD/.carry/httplib
[ -f "$h/include/httplib.h" ] || { echo "no .carry/httplib: run scripts/prepare_device_carry.sh"; exit 2; }
mkdir -p "$h/lib/pkgconfig"
cat > "$h/lib/pkgconfig/cpp-httplib.pc" <<PC
Name: cpp-httplib
Description: cpp-httplib carried from the development machine
Version: 0.11.4
Cflags: -I$h/include -DCPPHTTPLIB_OPENSSL_SUPPORT -DCPPHTTPLIB_ZLIB_SUPPORT -DCPPHTTPLIB_BROTLI_SUPPORT
Libs: -L$h/lib -lcpp-httplib -lssl -lcrypto
PC
export PKG_CONFIG_PATH=$h/lib/pkgconfig:/tmp/ferry-fabric/lib/pkgconfig
export LD_LIBRARY_PATH=$h/lib
if ! pkg-config --exists libfabric; then  # runtime from the system, headers carried
  lib=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
  mkdir -p /tmp/ferry-fabric/lib/pkgconfig
  ln -sf "$lib" /tmp/ferry-fabric/lib/libfabric.so
  printf 'Name: libfabric\nDescription: carried headers\nVersion: 1.17.0\nCflags: -I%s\nLibs: -L/tmp/ferry-fabric/lib -lfabric\n' \
    "$PWD/.carry/libfabric/include" > /tmp/ferry-fabric/lib/pkgconfig/libfabric.pc
fi
cmake -S . -B build-serve -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_WITH_CUDA=OFF \
  -DFERRY_BUILD_TESTS=OFF > /tmp/serve-configure.log 2>&1 || { tail -20 /tmp/serve-configure.log; exit 3; }
cmake --build build-serve -j "$(nproc)" --target ferry > /tmp/serve-build.log 2>&1 \
  || { grep -E "error" -A3 /tmp/serve-build.log | head -30; exit 4; }
echo "built; $(nproc) cores"
i=0
for args in "$@"; do
  i=$((i + 1))
  echo "== $args"
  rm -rf /tmp/sw
  eval scripts/sweep.sh -b build-serve -o /tmp/sw "$args" > /tmp/sw.log 2>&1 || tail -3 /tmp/sw.log
  python3 - <<'PY'
import glob, json
for f in sorted(glob.glob('/tmp/sw/*_qps*.json')):
    d = json.load(open(f))
    st = d['server_timing_ms']
    print(f.split('/')[-1][:-5],
          'ttft %.1f tpot %.2f tw %.2f dw %.2f share %.1f%% p99share %.1f%% fail %d unver %d' % (
              d['median_ttft_ms'], d['median_tpot_ms'], st['transfer_wait_ms']['median'],
              st['decode_wait_ms']['median'], 100 * d['median_wait_share'],
              100 * d['p99_wait_share'], d['failed'], d['verification_failures']))
PY
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/sweep_$i.tgz" -C /tmp sw; fi
done
