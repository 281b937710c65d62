# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates or refreshes the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-slow lint bench gpu-check clean

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
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy src

test-slow: venv
	$(PY) -m pytest -q -m "slow" -p no:cacheprovider

# Style and types (configured in pyproject.toml). Run both even when the first one finds something.
lint: venv
	$(PY) -m ruff check src tests benchmarks examples; r=$$?; $(PY) -m mypy src || exit 1; exit $$r

bench: venv
	$(VENV)/bin/offload-adamw bench

# On the GPU machine, with its own python3 and CUDA torch (no venv, no installs: it has no network):
# the GPU run (the gpu tests, CUDA parity, the ~1B model, PCIe, host threads), results in bench-out/gpu-run/.
gpu-check:
	PYTHON=$(PYTHON) bash benchmarks/gpu_run.sh bench-out/gpu-run

clean:
	rm -rf $(VENV) build *.egg-info
