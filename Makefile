# Entry points: `make demo` trains the default preset, `make test` runs ruff and the suite
# (it ends with the 15 slowest tests and the run's CPU time, workers included, and wall time),
# `make test-all` the suite with its slow cases (more layouts and families per claim),
# `make reference` the README's configuration tables from the config fields' comments,
# `make lock` the exact versions the suite and CI install (requirements/test.lock) from the
# ranges in pyproject.toml.

# The first Python 3.12 or newer found (JAX 0.12 needs it); PYTHON=... overrides.
PYTHON ?= $(firstword $(foreach p,python3.12 python3.13 python3 \
	$(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3), \
	$(shell $(p) -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 \
	&& command -v $(p))))
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements/test.lock

.PHONY: demo test test-all lint reference lock clean

# The virtual environment, made again where it is missing or of a Python older than 3.12,
# with the locked versions.
$(STAMP): pyproject.toml $(LOCK)
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || { \
		test -n "$(PYTHON)" || { echo "no Python 3.12 or newer found: install one (pyenv install 3.12, or your distribution's python3.12) or pass PYTHON=/path/to/python3.12" >&2; exit 2; }; \
		rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxmoe train --preset tiny --out runs/demo --overwrite

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# --dist loadscope: each test module runs whole on one worker, so the steps its tests share
# (module fixtures, cached helpers) compile and run once; a module split between workers
# builds them on each.
test: lint
	$(BIN)/python -m pytest -n auto --dist loadscope

test-all: lint
	$(BIN)/python -m pytest -n auto --dist loadscope --slow

# The README's configuration tables, rewritten from the comments of the config fields.
reference: $(STAMP)
	$(BIN)/python -m jaxmoe.config.reference --write README.md

# Resolved for Linux x86-64 and Python 3.12, where CI runs.
lock: $(STAMP)
	$(BIN)/python -m pip install --quiet uv
	$(BIN)/uv pip compile pyproject.toml --extra test --python-version 3.12 \
		--python-platform x86_64-manylinux_2_28 --no-header --quiet -o $(LOCK)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
