#!/usr/bin/env bash
# The Python package as `pip install .` builds it on a GPU machine, for that machine's python3
# and its torch, and the CUDA tensor tests run against the installed package (not the build
# tree). Called by scripts/gpu_check.sh after its own setup (libfabric and OpenSSL headers).
# The lent machines reach no package index: the pinned tools of requirements/build.txt come
# from .carry/wheels (scripts/prepare_device_carry.sh fills it), and the venv sees the
# machine's own packages (torch, numpy). FERRY_CMAKE_FLAGS as for gpu_check.sh; the Python is
# FERRY_GPU_PYTHON (default python3). Logs under $OUT (or ./out).
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
log() { echo "[gpu_pip_check $(date +%H:%M:%S)] $*" | tee -a "$out/gpu_check.log"; }
py=${FERRY_GPU_PYTHON:-python3}
venv=/tmp/ferry-pip-venv

torch=$("$py" -c "import torch; print(torch.__version__)" 2>&1 | tail -1)
log "pip install . for $(command -v "$py") ($("$py" --version 2>&1); torch: $torch)"
rm -rf "$venv"
"$py" -m venv --system-site-packages "$venv" || { log "$py -m venv failed"; exit 5; }
# Where $py is itself a venv (the lent machines' torch lives in one), --system-site-packages
# shows the base interpreter's packages, not $py's: a .pth file adds $py's site-packages.
"$py" -c "import site; print('\n'.join(site.getsitepackages()))" \
  > "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/ferry-base.pth"
grep -v '^numpy' requirements/build.txt > "$venv/build-tools.txt"
"$venv/bin/python" -m pip install -q --no-index --find-links .carry/wheels \
  -r "$venv/build-tools.txt" > "$out/pip_tools.log" 2>&1 \
  || { tail -5 "$out/pip_tools.log"; log "no build tools in .carry/wheels: run scripts/prepare_device_carry.sh here"; exit 5; }

t0=$(date +%s)
CMAKE_ARGS="${FERRY_CMAKE_FLAGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$venv/bin/python" -m pip install -v --no-index --find-links .carry/wheels --no-build-isolation . \
  --config-settings=build-dir=build-gpu-pip > "$out/pip_install.log" 2>&1 \
  || { grep -E "error|Error" -A3 "$out/pip_install.log" | head -40; log "pip install . failed"; exit 6; }
log "pip install . took $(( $(date +%s) - t0 )) s: $(grep -oE "ferry: (CUDA support|Python bindings) [^(]*" "$out/pip_install.log" | tr '\n' ' ')"
where=$(cd /tmp && "$venv/bin/python" -c "import ferry; print(ferry.__file__)") \
  || { log "import ferry from the venv failed"; exit 7; }
case "$where" in "$venv"/*) ;; *) log "ferry imported from $where, not the venv"; exit 7 ;; esac
log "python GPU tests against $where"
# `python -m pytest` puts the repository root on sys.path, which holds no `ferry` package.
timeout 400 "$venv/bin/python" -m pytest python/tests/test_gpu.py python/tests/test_moe_gpu.py \
  python/tests/test_kv_gpu.py -q -rs -p no:cacheprovider > "$out/python_gpu_pip.log" 2>&1
rc=$?
tail -3 "$out/python_gpu_pip.log" | tee -a "$out/gpu_check.log"
# Issue 31: a SIGTERM during `import ferry` ends the process as SIGTERM with this machine's
# Python and torch too (its numpy's threads are what made it hang once).
log "SIGTERM during import ferry, against $where"
timeout 300 "$venv/bin/python" -m pytest python/tests/test_adversarial.py -k sigterm_during_import \
  -q -rs -p no:cacheprovider > "$out/python_sigterm_pip.log" 2>&1 || rc=1
tail -1 "$out/python_sigterm_pip.log" | tee -a "$out/gpu_check.log"
exit $rc
