#!/usr/bin/env bash
# Makes (or refreshes) the Python virtual environment the build and the tests use:
#   bash scripts/venv.sh DIR [PYTHON]
# DIR is made from PYTHON (default: the first python3 on PATH) with the system's packages
# visible, and requirements/test.txt installed by pip: the pinned build tools of
# requirements/build.txt (scikit-build-core, pybind11, pytest, numpy) and torch from PyPI.
# Reused between runs: pip runs again only when a requirements file is newer than the last
# install. torch is a download of a few GB the first time (pip caches it).
set -euo pipefail
dir=${1:?usage: venv.sh DIR [PYTHON]}
python=${2:-python3}
reqs="$(cd "$(dirname "$0")/.." && pwd)/requirements"
stamp="$dir/.requirements-installed"

if [ ! -x "$dir/bin/python3" ]; then
  command -v "$python" > /dev/null || { echo "venv: no $python on PATH" >&2; exit 1; }
  echo "venv: making $dir from $(command -v "$python") ($("$python" --version 2>&1))"
  if ! "$python" -m venv --system-site-packages "$dir"; then
    echo "venv: '$python -m venv' failed; on Debian: apt-get install python3-venv" >&2
    rm -rf "$dir"
    exit 1
  fi
fi
if [ ! -e "$stamp" ] || [ "$reqs/build.txt" -nt "$stamp" ] || [ "$reqs/test.txt" -nt "$stamp" ]; then
  echo "venv: installing requirements/test.txt into $dir (torch: a few GB the first time)"
  start=$(date +%s)
  "$dir/bin/python3" -m pip install -q --disable-pip-version-check -r "$reqs/test.txt"
  echo "venv: installed in $(($(date +%s) - start)) s"
  touch "$stamp"
fi
