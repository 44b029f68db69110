#!/usr/bin/env bash
# Makes (or refreshes) the Python virtual environment the build and the tests use:
#   bash scripts/venv.sh DIR [PYTHON]
# DIR is made from PYTHON (default: the first python3 on PATH) with the system's packages
# visible (Debian's numpy and torch, scripts/setup.sh), and the pinned tools of
# requirements/build.txt (scikit-build-core, pybind11, pytest) installed by pip. Reused between
# runs: pip runs again only when requirements/build.txt is newer than the last install.
set -euo pipefail
dir=${1:?usage: venv.sh DIR [PYTHON]}
python=${2:-python3}
req="$(cd "$(dirname "$0")/.." && pwd)/requirements/build.txt"
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
if [ ! -e "$stamp" ] || [ "$req" -nt "$stamp" ]; then
  echo "venv: installing requirements/build.txt into $dir"
  "$dir/bin/python3" -m pip install -q --disable-pip-version-check -r "$req"
  touch "$stamp"
fi
