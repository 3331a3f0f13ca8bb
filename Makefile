# Two commands do all set-up on a fresh machine (Python 3.11, Java 17+, Maven):
#   make demo   - run the live demo
#   make test   - run the whole test suite (what CI runs)
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: help demo test lint unit integration setup browser dashboard bench clean
.DEFAULT_GOAL := help

help:
	@echo "make demo   run the demo: broker, live fleet, stream, trainer, dashboard, MLflow UI (Ctrl-C drains and reconciles)"
	@echo "make test   lint and run every test against a real Kafka broker, Spark and Delta"
	@echo "make dashboard   the ops dashboard on http://127.0.0.1:8050/ alone (make demo starts one too)"
	@echo "make bench  measure this machine: ceilings, pipeline throughput, latency, scale, training cost (about 10 minutes)"
	@echo "make unit | integration | lint | setup | browser | clean"

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	@command -v java >/dev/null || { echo "java not found: install a JDK 17+ (e.g. apt-get install openjdk-17-jdk-headless)"; exit 1; }
	@command -v mvn >/dev/null || { echo "mvn not found: install Maven (e.g. apt-get install maven); it downloads the Kafka and Spark jars once"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --progress-bar off -e '.[dev]'
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
	$(BIN)/pytest $(ARGS)

unit: setup
	$(BIN)/pytest -m "not integration" $(ARGS)

integration: setup browser
	$(BIN)/pytest -m integration $(ARGS)

clean:
	-$(BIN)/iotmon kafka stop
	rm -rf var $(VENV) .pytest_cache .ruff_cache *.egg-info
