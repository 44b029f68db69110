#!/usr/bin/env bash
# Which Python the CMake build takes, and what it says when it cannot build the bindings:
#   python_select_test.sh SRC PYTHON
# A virtual environment made from PYTHON (without pybind11) comes first on PATH, and the project
# is configured without -DPython3_EXECUTABLE, as a user with an active venv would:
# 1. the bindings are built for that venv's python3 (system pybind11 serves it), not a fixed
#    /usr/bin/python3;
# 2. with no pybind11 anywhere, the warning names that interpreter and the pip command that
#    installs what it lacks, and the configure still succeeds (the C++ parts build);
# 3. under pip (SKBUILD) the same is an error: a wheel without its extension is of no use.
set -euo pipefail
src=$(cd "${1:?usage: python_select_test.sh SRC PYTHON}" && pwd)
python=${2:?}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "python_select_test: FAILED: $*" >&2; exit 1; }

"$python" -m venv --without-pip "$tmp/venv" || fail "python -m venv"
venv_py="$tmp/venv/bin/python3"
configure() {  # NAME ARGS...: configure into $tmp/NAME with the venv first on PATH
  local name=$1; shift
  PATH="$tmp/venv/bin:$PATH" cmake -S "$src" -B "$tmp/$name" -G Ninja -DFERRY_BUILD_TESTS=OFF \
    -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_SERVE=OFF "$@" > "$tmp/$name.log" 2>&1
}
flat() { tr -s ' \n' ' ' < "$1"; }  # CMake wraps warnings over several lines

configure found || { cat "$tmp/found.log"; fail "configure with the venv on PATH"; }
flat "$tmp/found.log" | grep -q "Python bindings ON ($venv_py," \
  || { cat "$tmp/found.log"; fail "the bindings were not built for the venv's $venv_py"; }

configure missing -DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON \
  || { cat "$tmp/missing.log"; fail "configure without pybind11 failed (should only warn)"; }
flat "$tmp/missing.log" | grep -q "pybind11 was found neither for $venv_py .*$venv_py -m pip install" \
  || { cat "$tmp/missing.log"; fail "the warning does not name $venv_py and its pip command"; }

if configure skbuild -DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON -DSKBUILD=ON \
     -DSKBUILD_SCRIPTS_DIR="$tmp/scripts"; then
  fail "a pip build without pybind11 configured anyway"
fi
flat "$tmp/skbuild.log" | grep -q "cannot build the Python package: pybind11 was found neither" \
  || { cat "$tmp/skbuild.log"; fail "the pip build's error does not say pybind11 is missing"; }
echo "python_select_test: passed"
