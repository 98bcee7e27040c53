# Every target sets up the venv it needs first (python3 -m venv + pip install -e .[dev]).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv run test test-slow test-all equivalence ui clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The main job (README quick start): the stage-by-stage equivalence check of ViT-B/16,
# logged to the embedded MLflow store sqlite:///mlflow.db.
run: $(STAMP)
	mlflow run . -e equivalence --env-manager local

# The default test tier: fast, offline, CPU.
test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

test-all: $(STAMP)
	$(PY) -m pytest -m ''

ui: $(STAMP)
	mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
