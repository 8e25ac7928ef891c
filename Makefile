# Two entry points for a fresh machine with Python 3.11+ and make:
#   make demo   -> creates .venv, installs touba with every extra, runs `touba demo`
#   make test   -> same install, then lint, strict type check and the whole test suite
#   make peers  -> same install, then openai-agents' own session tests against ToubaSession
#   make bench  -> same install plus the `bench` extra, then every script of bench/
#                  (bench/soak.py for 1 minute a store; the 30-minute soak:
#                  `nice .venv/bin/python bench/soak.py --minutes 30 --stores postgres`)
#   make docs   -> same install plus the `docs` extra, then `mkdocs build --strict` (build/site)
#   make real-servers -> same install plus the `real-servers` extra, builds llama-cpp-python
#                  once into ~/.cache/touba/wheels (about 5 minutes on 2 cores; reused
#                  after), installs it and runs tests/real_servers/ against its server
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
DOCS_STAMP := $(VENV)/.installed-docs
REAL_SERVERS_STAMP := $(VENV)/.installed-real-servers

.PHONY: install demo test lint typecheck pytest peers bench docs real-servers clean

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

# Fetches the pinned openai-agents sdist into .peers/ (pip download) and runs its session
# tests with SQLiteSession swapped for ToubaSession: tests/peers/run_openai_agents.py.
peers: install
	$(BIN)/python tests/peers/run_openai_agents.py
	$(BIN)/python tests/peers/run_adk.py
	$(BIN)/python tests/peers/run_langgraph.py

# The peers bench/peers.py compares touba with come from the `bench` extra.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[all,dev,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/peers.py
	$(BIN)/python bench/sessions.py
	$(BIN)/python bench/adk_redis.py
	$(BIN)/python bench/pydantic_ai_runs.py
	$(BIN)/python bench/history_cost.py
	$(BIN)/python bench/encryption_cost.py
	$(BIN)/python bench/provider_cost.py
	$(BIN)/python bench/stream_cost.py
	$(BIN)/python bench/chat_traffic.py
	$(BIN)/python bench/panel_pages.py
	$(BIN)/python bench/memory_encryption.py
	$(BIN)/python bench/copy_stores.py
	$(BIN)/python bench/retention.py
	$(BIN)/python bench/langgraph_saver.py
	$(BIN)/python bench/adk_postgres.py
	$(BIN)/python bench/langgraph_redis.py
	$(BIN)/python bench/langgraph_postgres.py
	$(BIN)/python bench/adk_sessions.py
	$(BIN)/python bench/server_crashes.py
	$(BIN)/python bench/latency.py --chat
	$(BIN)/python bench/pg_writers.py
	$(BIN)/python bench/pg_deadlines.py
	$(BIN)/python bench/deadlines.py
	$(BIN)/python bench/owed_release_outages.py
	$(BIN)/python bench/load.py
	$(BIN)/python bench/soak.py --minutes 1

# The docs site (mkdocs.yml): strict, so a broken link, page or API reference fails the
# build; it reaches no network (no social cards, no privacy plugin, no remote assets).
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[all,dev,docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# llama-cpp-python's own OpenAI-compatible server, run on a tiny random model the tests
# write (tests/real_servers/). build_llama.py compiles the pinned sdist once (CPU only, no
# curl) into the user cache and installs the wheel; without AVX2 or a build tool it says so
# and the suite skips with the reason (fails under CI=true).
$(REAL_SERVERS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[all,dev,real-servers]"
	touch $(REAL_SERVERS_STAMP)

real-servers: $(REAL_SERVERS_STAMP)
	$(BIN)/python tests/real_servers/build_llama.py
	$(BIN)/python -m pytest -m real_server tests/real_servers

clean:
	rm -rf $(VENV) build/site .pytest_cache .mypy_cache .ruff_cache .hypothesis .peers
