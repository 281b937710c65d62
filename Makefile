# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (which also builds the
# documentation site, `make docs`). Each creates or refreshes the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
# Every version the environments install (requirements/pins.txt says how to move them). Each pip run of the
# recipes, the clean-install test's included, reads it through the environment; `make test-latest` empties it.
PINS ?= requirements/pins.txt

ifneq ($(PINS),)
export PIP_CONSTRAINT := $(abspath $(PINS))
export PIP_BUILD_CONSTRAINT := $(abspath $(PINS))
endif

.PHONY: venv demo test test-slow test-latest pins lint docs bench gpu-check clean

$(STAMP): pyproject.toml Makefile $(PINS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The `docs` extra (pyproject.toml) on top of the test environment.
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

demo: venv
	$(VENV)/bin/offload-adamw demo

# The second line: a clean virtual environment (torch and this project, no extras) saves and loads a
# checkpoint and runs plan and check; it is slow (two pip installs), so it runs on its own.
# The docs extra comes first, so that tests/test_docs_site.py builds the site; the last line builds it as `make docs` does.
test: venv $(DOCS_STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" -p no:cacheprovider
	$(PY) -m pytest -q -m slow -p no:cacheprovider tests/test_clean_install.py
	$(PY) -m ruff check src tests benchmarks examples docs
	$(PY) -m mypy src
	$(MAKE) --no-print-directory docs

# Every slow test but the clean install, which `make test` runs; CI runs it after `make test`.
test-slow: venv
	$(PY) -m pytest -q -m "slow and not gpu" -p no:cacheprovider --deselect tests/test_clean_install.py

# The suite against the newest releases of everything but torch, in a venv of its own (not part of CI): what
# `make pins` would move to. A failure here is a release to look at before moving the pins.
test-latest:
	env -u PIP_CONSTRAINT -u PIP_BUILD_CONSTRAINT $(MAKE) --no-print-directory test VENV=.venv-latest PINS=

# Move the pins to the newest releases: a fresh venv without them, frozen into requirements/pins.txt (torch
# stays at the build the Makefile installs). Run `make test` after it and commit the file with what it changed.
pins:
	rm -rf .venv-pins
	env -u PIP_CONSTRAINT -u PIP_BUILD_CONSTRAINT $(MAKE) --no-print-directory $(abspath .venv-pins)/.docs-installed \
		VENV=$(abspath .venv-pins) PINS=
	sed -n '/^#/p' requirements/pins.txt > requirements/pins.txt.new
	.venv-pins/bin/python -m pip freeze --all --exclude-editable | sed -E 's/^torch==([0-9.]+)\+[a-z0-9]+$$/torch==\1/' \
		| sort -f >> requirements/pins.txt.new
	mv requirements/pins.txt.new requirements/pins.txt
	rm -rf .venv-pins

# Style and types (configured in pyproject.toml). Run both even when the first one finds something.
lint: venv
	$(PY) -m ruff check src tests benchmarks examples docs; r=$$?; $(PY) -m mypy src || exit 1; exit $$r

# The documentation site from docs/ (mkdocs.yml) into build/site, every warning an error: a broken link or
# anchor, an unresolved cross-reference, a docstring that does not parse, a page missing from the navigation.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --clean --site-dir build/site

bench: venv
	$(VENV)/bin/offload-adamw bench

# On the GPU machine, with its own python3 and CUDA torch (no venv, no installs: it has no network): the GPU run,
# `offload-adamw selftest --bench` (parity, PCIe, host step, the ~1B Llama) then the gpu tests, within 9 minutes,
# at most 4 files in $(OUT) (benchmarks/gpu_check.sh): OUT from the environment where it is set, as on the lent machine.
OUT ?= bench-out/gpu-run
gpu-check:
	PYTHON=$(PYTHON) bash benchmarks/gpu_check.sh $(OUT)

clean:
	rm -rf $(VENV) .venv-latest .venv-pins build *.egg-info
