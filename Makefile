# Entry points: `make demo` trains the default preset, `make test` runs ruff and the suite
# (it ends with the 15 slowest tests and the run's CPU time, workers included, and wall time),
# `make test-all` the suite with its slow cases (more layouts and families per claim),
# `make reference` the README's configuration tables from the config fields' comments.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint reference clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxmoe train --preset tiny --out runs/demo --overwrite

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -n auto --dist worksteal

test-all: lint
	$(BIN)/python -m pytest -n auto --dist worksteal --slow

# The README's configuration tables, rewritten from the comments of the config fields.
reference: $(STAMP)
	$(BIN)/python -m jaxmoe.config.reference --write README.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
