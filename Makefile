# Two entry points for a fresh machine with Python 3.11+ and make:
#   make demo   -> creates .venv, installs touba with every extra, runs `touba demo`
#   make test   -> same install, then lint, strict type check and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck pytest bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[all,dev]"
	touch $(STAMP)

demo: install
	$(BIN)/touba demo

test: lint typecheck pytest

lint: install
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/history_cost.py
	$(BIN)/python bench/provider_cost.py
	$(BIN)/python bench/chat_traffic.py
	$(BIN)/python bench/panel_pages.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
