# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates or refreshes the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-slow bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/offload-adamw demo

# The second line: a clean virtual environment (torch and this project, no extras) saves and loads a
# checkpoint and runs plan and check; it is slow (two pip installs), so it runs on its own.
test: venv
	$(PY) -m pytest -q -m "not slow and not gpu" -p no:cacheprovider
	$(PY) -m pytest -q -m slow -p no:cacheprovider tests/test_clean_install.py

test-slow: venv
	$(PY) -m pytest -q -m "slow" -p no:cacheprovider

bench: venv
	$(VENV)/bin/offload-adamw bench

# On a machine with an NVIDIA GPU (and a CUDA build of torch in the venv): the GPU tests, then the
# GPU benchmark (parity, peak device memory, ~1B step time, PCIe fraction) as JSON in bench-out/.
gpu-check: venv
	$(PY) -m pytest -q -m gpu -p no:cacheprovider
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info
