# Two commands do all set-up on a fresh machine (Python 3.11, Java 17+, Maven):
#   make demo   - run the live demo
#   make test   - run the whole test suite (what CI runs)
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
# The resolver behind `make lock`, in a venv of its own under var/: the project's venv holds only what the lock names.
UV_VERSION := 0.13.9
UV_VENV    := var/tools/uv-$(UV_VERSION)
UV         := $(UV_VENV)/bin/uv

# The tests run on two pytest-xdist workers, each with its own broker and Spark session: most tests keep one core
# busy (a Spark driver planning small batches, a process starting), so two at once fill a 2-core machine.
# How tests share the workers: tests/conftest.py (the collection's order kept, not xdist's reordering by module
# size). WORKERS=0 runs them one at a time in one process.
WORKERS ?= 2
PYTEST  := $(BIN)/pytest -n $(WORKERS) --no-loadscope-reorder

.PHONY: help demo test lint unit integration setup browser dashboard bench lock clean
.DEFAULT_GOAL := help

help:
	@echo "make demo   run the demo: broker, live fleet, stream, trainer, dashboard, MLflow UI (Ctrl-C drains and reconciles)"
	@echo "make test   lint and run every test against a real Kafka broker, Spark and Delta"
	@echo "make dashboard   the ops dashboard on http://127.0.0.1:8050/ alone (make demo starts one too)"
	@echo "make bench  measure this machine: ceilings, pipeline throughput, latency, scale, training cost (about 10 minutes)"
	@echo "make lock   refresh requirements.lock from pyproject.toml's ranges (see docs/install.md)"
	@echo "make unit | integration | lint | setup | browser | clean"

# The exact versions the tests run with (requirements.lock), then the project itself, editable, without
# resolving anything more: a dependency missing from the lock fails here, it is not picked up at its newest.
$(STAMP): pyproject.toml $(LOCK)
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	@command -v java >/dev/null || { echo "java not found: install a JDK 17+ (e.g. apt-get install openjdk-17-jdk-headless)"; exit 1; }
	@command -v mvn >/dev/null || { echo "mvn not found: install Maven (e.g. apt-get install maven); it downloads the Kafka and Spark jars once"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --progress-bar off -r $(LOCK)
	$(BIN)/pip install --quiet --progress-bar off --no-deps -e .
	$(BIN)/pip check
	touch $(STAMP)

setup: $(STAMP)
	$(BIN)/iotmon setup

demo: setup
	$(BIN)/iotmon demo $(ARGS)

dashboard: setup
	$(BIN)/iotmon dashboard $(ARGS)

bench: setup
	$(BIN)/iotmon bench $(ARGS)

# Debian's chromium and chromium-driver for the dashboard's browser test (apt-get; nothing if present).
browser:
	@.ci/install-browser

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup lint browser
	$(PYTEST) $(ARGS)

unit: setup
	$(PYTEST) -m "not integration" $(ARGS)

integration: setup browser
	$(PYTEST) -m integration $(ARGS)

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install --quiet --progress-bar off uv==$(UV_VERSION)

# Re-resolve the lock from pyproject.toml's ranges (the main and dev dependencies) for Python 3.11 on x86-64
# Linux, what CI and the image run: every pin that still fits is kept and only what changed is resolved anew.
# ARGS=--upgrade moves every pin to the newest version allowed, ARGS="--upgrade-package NAME" one. Then `make test`.
lock: $(UV)
	$(UV) pip compile pyproject.toml --extra dev --python-version 3.11 --python-platform x86_64-unknown-linux-gnu \
		--custom-compile-command "make lock" --quiet --output-file $(LOCK) $(ARGS)

clean:
	-$(BIN)/iotmon kafka stop
	rm -rf var $(VENV) .pytest_cache .ruff_cache *.egg-info
