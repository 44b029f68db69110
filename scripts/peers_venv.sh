#!/usr/bin/env bash
# Makes (or refreshes) the virtual environment `python3 -m ferry.bench_peers` runs in:
#   bash scripts/peers_venv.sh [DIR] [PYTHON] [FERRY_WHEEL]
# DIR (default build/peers-venv) is made from PYTHON (default: the first python3 on PATH) with
# the peers pinned in requirements/peers.txt (NIXL, Mooncake's TransferEngine, UCCL where the
# Python is new enough), the build tools of requirements/build.txt, and ferry itself
# (`pip install .`, built in build/pip/<wheel tag>; or FERRY_WHEEL, a wheel already built, as
# .ci/run passes the one it tested). The peers go in with --no-deps:
# requirements/peers.txt says why. pip runs again only when a requirements file is newer than
# the last install; ferry is reinstalled every time (a rebuild without changes takes seconds).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir=${1:-$root/build/peers-venv}
python=${2:-python3}
wheel=${3:-}
stamp="$dir/.peers-installed"

if [ ! -x "$dir/bin/python3" ]; then
  command -v "$python" > /dev/null || { echo "peers_venv: no $python on PATH" >&2; exit 1; }
  echo "peers_venv: making $dir from $("$python" --version 2>&1)"
  if ! "$python" -m venv "$dir"; then
    echo "peers_venv: '$python -m venv' failed; on Debian: apt-get install python3-venv" >&2
    rm -rf "$dir"
    exit 1
  fi
fi
pip=("$dir/bin/python3" -m pip install -q --disable-pip-version-check)
if [ ! -e "$stamp" ] || [ "$root/requirements/peers.txt" -nt "$stamp" ] ||
   [ "$root/requirements/build.txt" -nt "$stamp" ]; then
  echo "peers_venv: installing requirements/build.txt and requirements/peers.txt"
  "${pip[@]}" -r "$root/requirements/build.txt"
  "${pip[@]}" --no-deps -r "$root/requirements/peers.txt"
  touch "$stamp"
fi
if [ -n "$wheel" ]; then
  echo "peers_venv: installing ferry from $(basename "$wheel")"
  "${pip[@]}" --force-reinstall --no-deps "$wheel"
else
  echo "peers_venv: installing ferry (pip install .)"
  (cd "$root" && "${pip[@]}" --no-build-isolation .)
fi
"$dir/bin/python3" -m ferry.bench_peers --list
