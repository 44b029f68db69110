#!/usr/bin/env bash
# Installs everything ferry needs to build and test, from Debian packages. Idempotent: a
# package that is already installed is left alone, and apt-get runs only when one is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libfabric-dev libfabric-bin
  libssl-dev
  libhwloc-dev
  libgtest-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev libcpp-httplib-dev
  python3-matplotlib
  python3-dev python3-venv pybind11-dev python3-numpy python3-pytest
  iproute2 procps
  clang-format
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "setup: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
