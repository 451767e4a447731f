# Two commands: `make demo` and `make test`. Each creates .venv when missing and installs
# everything it needs into it from the package registries.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev,metrics,gym]' --config-settings editable_mode=compat
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m h5replay demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/storage.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
