# Every target sets up the venv it needs first (python3 -m venv + pip install -e .[dev]).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv run test test-fast test-slow test-all lint format equivalence fashion-mnist ui clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The main job (README quick start): the smoke protocol (real Fashion-MNIST, both arms,
# two paired seeds) logged to the embedded MLflow store sqlite:///mlflow.db. Fashion-MNIST
# comes from Debian's package when apt is usable, else from the usual download.
run: $(STAMP) fashion-mnist
	mlflow run . -e ablate --env-manager local -P download=true

equivalence: $(STAMP)
	mlflow run . -e equivalence --env-manager local

fashion-mnist:
	@test -d /usr/share/datasets/fashion-mnist || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) \
	  || echo "Fashion-MNIST not installed system-wide; it will be downloaded"; }

# Test tiers (pytest markers, declared in pyproject.toml; docs/testing.md):
#   test       the default tier: every test not marked `slow`, integration tests included
#              (they start PostgreSQL / an MLflow server on 127.0.0.1 and skip where
#              PostgreSQL is absent). At most 5 minutes on 2 idle cores.
#   test-fast  no server, nothing slow, nothing end to end (`e2e`: a real MLflow store,
#              trainings, subprocess kills): the edit-and-rerun loop (at most 90 s).
#   test-slow  full-size models (ViT-B/L equivalence) and long kill-and-resume tests.
#   test-all   every tier.
test: $(STAMP)
	$(PY) -m pytest

# ruff (rules and line length in pyproject.toml): `make format` rewrites, `make lint` only checks.
# A reformat moves no code identity (the fingerprint hashes syntax trees: docs/study-record.md).
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not integration and not e2e"

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

test-all: $(STAMP)
	$(PY) -m pytest -m ''

# The MLflow UI on the embedded store. It first prints each study's runs page: MLflow 3.17 opens an
# experiment on its GenAI "Overview" unless the address says ?workflowType=machine_learning.
ui: $(STAMP)
	@$(PY) -m tracking.store.ui_links sqlite:///mlflow.db http://127.0.0.1:5000
	mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
