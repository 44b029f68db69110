#!/usr/bin/env bash
# ctest's vllm_api, vllm_scheduler, vllm_pd and vllm_router: ferry's vLLM connector tests
# (python/tests/vllm/) in the vLLM virtual environment, when there is one:
#   run_vllm_tests.sh SOURCE_DIR BUILD_PYTHON_DIR VENV TEST_FILE
# VENV (build/vllm-venv, made by scripts/vllm_venv.sh) holds the pinned vLLM and torch. ferry
# comes from the build tree (BUILD_PYTHON_DIR, this build's extension) when that imports in the
# venv's interpreter, else from the venv's own `pip install .`. Without VENV the test is skipped
# (exit 77, ctest's SKIP_RETURN_CODE) with the command that makes it.
set -euo pipefail
src=${1:?usage: run_vllm_tests.sh SOURCE_DIR BUILD_PYTHON_DIR VENV TEST_FILE}
pydir=${2:?}
venv=${3:?}
test=${4:?}
py="$venv/bin/python3"
if [ ! -x "$py" ] || ! "$py" -c 'import vllm' > /dev/null 2>&1; then
  echo "SKIPPED: no vLLM environment at $venv; make it with: bash scripts/vllm_venv.sh" \
    "(about 3 minutes and 6 GB; requirements/vllm.txt)"
  exit 77
fi
if PYTHONPATH="$pydir" "$py" -c 'import ferry._ferry' > /dev/null 2>&1; then
  export PYTHONPATH="$pydir"
  echo "vllm tests: ferry from the build tree ($pydir)"
else
  echo "vllm tests: ferry as installed in $venv (the build tree's extension is for another" \
    "Python); rerun scripts/vllm_venv.sh after changing ferry"
fi
export PYTHONDONTWRITEBYTECODE=1
exec "$py" -m pytest "$src/python/tests/vllm/$test" -q -p no:cacheprovider -rs
