"""Shared test setup and fixtures: CPU only, few threads, every MLflow store and data cache inside tmp_path.

Tiers (markers, see pyproject.toml and docs/testing.md): the default run is `-m 'not slow'`;
`slow` holds full-size models and long kill tests; `integration` marks every test that starts
a server (enforced below); `e2e` marks end-to-end tests (set below for every test with an
MLflow store), which `make test-fast` leaves out.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# On a tracking server every new parent or cell run waits this long before it looks for
# another execution's candidate (tracking/record/create_once.py, default 2 s). Tests with one
# execution at a time need no such wait; tests/test_concurrent_server.py gives its
# executions the default (its subprocesses get no WORKBENCH_* variable).
os.environ.setdefault("WORKBENCH_CLAIM_SETTLE_SECONDS", "0.2")

# Fixtures that give a test a real MLflow store: such a test runs trainings or studies
# end to end, so it is marked `e2e` and left out of `make test-fast` (still in the default tier).
STORE_FIXTURES = {"mlflow_store", "store", "isolated_tracking"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if STORE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _no_lease_outlives_its_test():
    """Runs a test left held (a simulated crash) must not be renewed during later tests.

    The heartbeat thread renews every held run in turn; one whose store went away with its
    test's tmp_path would cost each later beat seconds and let a later test's lease expire.
    """
    yield
    from tracking.record.lease import HEARTBEATS

    with HEARTBEATS._lock:
        HEARTBEATS._held.clear()
        HEARTBEATS._lost.clear()
        HEARTBEATS._extra.clear()


# A process that is a server: `mlflow server`, PostgreSQL's initdb / pg_ctl / postgres.
SERVER_COMMAND = re.compile(r"\bmlflow\b.*\bserver\b|\b(initdb|pg_ctl|postgres)\b")


@pytest.fixture(autouse=True)
def _servers_only_in_integration_tests(request, monkeypatch):
    """Fail a test that starts a server without the `integration` mark, so the tiers stay honest."""
    if request.node.get_closest_marker("integration"):
        return
    real = subprocess.Popen

    class Guarded(real):
        def __init__(self, args, *rest, **kwargs):
            text = args if isinstance(args, (str, bytes)) else " ".join(map(str, args))
            if SERVER_COMMAND.search(str(text)):
                pytest.fail(
                    f"{request.node.nodeid} starts a server ({str(text)[:60]}...): "
                    "mark it @pytest.mark.integration",
                    pytrace=False,
                )
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Guarded)


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory) -> Path:
    """An empty, fully migrated MLflow SQLite file: creating one takes seconds, copying it none."""
    import mlflow
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{path}")
    MlflowClient().search_experiments()  # runs the schema migrations
    mlflow.set_tracking_uri(previous)
    return path


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch, empty_mlflow_db):
    """A real local MLflow store (SQLite + artifact folder) that the code under test uses.

    It starts as a copy of the migrated template, so no test pays for MLflow's migrations.
    """
    shutil.copyfile(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)  # default artifact root ./mlruns lands in tmp_path
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    previous = tracking_utils._tracking_uri  # what mlflow.set_tracking_uri last set, if anything
    mlflow.set_tracking_uri(uri)
    yield uri
    while mlflow.active_run():
        mlflow.end_run()
    tracking_utils._tracking_uri = previous  # no later test inherits this store


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    """Fail with the max difference shown, so a failure says by how much."""
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
    assert diff <= atol, f"{what}: max |difference| {diff:.3g} > tolerance {atol:g}"


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """Data cache in tmp_path, no data dir, no system copies, downloads forbidden."""
    from workbench.data import locate

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("WORKBENCH_DATA_DIR", raising=False)
    monkeypatch.setattr(locate, "SYSTEM_DIRS", {})

    def no_network(root, size):
        raise AssertionError("tests must not download")

    for name in list(locate.DOWNLOADERS):
        monkeypatch.setitem(locate.DOWNLOADERS, name, no_network)
    return tmp_path
