# Entry points: `make demo` trains the default preset, `make test` runs ruff and the suite,
# `make test-all` the suite with its slow cases (more layouts and families per claim).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint clean

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

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
