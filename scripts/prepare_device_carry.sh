#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what the lent GPU machines lack, for the device tool's
# `carry` option: libfabric's headers (the runtime is there), OpenSSL's libcrypto headers and
# library (the deployment secret's HMAC; CMakeLists.txt uses .carry/openssl when the system has
# no OpenSSL headers), hwloc's headers and library (.carry/hwloc, likewise) and, for the serving stack,
# cpp-httplib with the headers and libraries it is built against (OpenSSL, zlib, brotli).
# Run here after scripts/setup.sh; then pass carry [".carry"] to the device tool.
set -euo pipefail
cd "$(dirname "$0")/.."
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
rm -rf .carry/libfabric .carry/httplib .carry/openssl
mkdir -p .carry/libfabric/include .carry/httplib/include .carry/httplib/lib
cp -r /usr/include/rdma .carry/libfabric/include/
o=.carry/openssl
mkdir -p "$o/include" "$o/lib"
cp -r /usr/include/openssl "$o/include/"
cp /usr/include/"$arch"/openssl/* "$o/include/openssl/"
cp -a /lib/"$arch"/libcrypto.so.3 "$o/lib/"
ln -sf libcrypto.so.3 "$o/lib/libcrypto.so"
# hwloc's headers and library (the topology: src/fabric/topology.cc).
w=.carry/hwloc
rm -rf "$w"
mkdir -p "$w/include" "$w/lib"
cp -r /usr/include/hwloc.h /usr/include/hwloc "$w/include/"
cp -a /usr/lib/"$arch"/libhwloc.so* "$w/lib/"
h=.carry/httplib
cp /usr/include/httplib.h /usr/include/zlib.h /usr/include/zconf.h "$h/include/"
cp -r /usr/include/openssl /usr/include/brotli "$h/include/"
cp /usr/include/"$arch"/openssl/* "$h/include/openssl/"
cp -a /usr/lib/"$arch"/libcpp-httplib.so* /usr/lib/"$arch"/libbrotli*.so* "$h/lib/"
cp -a /lib/"$arch"/libssl.so.3 /lib/"$arch"/libcrypto.so.3 "$h/lib/"
# The pinned Python build tools (requirements/build.txt, numpy left out: the machines have
# their own) as wheels, for scripts/gpu_pip_check.sh: the machines reach no package index.
# They are pure Python; their dependencies differ by Python version, hence the loop.
rm -rf .carry/wheels
grep -v '^numpy' requirements/build.txt > .carry/build-tools.txt
for v in 3.10 3.11 3.12 3.13; do
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$v" \
    -d .carry/wheels -r .carry/build-tools.txt
done
du -sh .carry
# numpy (ferry's one run-time requirement) for the machines' Python 3.12, where their torch
# environment has none: pip takes it from .carry/wheels only when missing.
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  -d .carry/wheels "numpy>=1.21"
