"""The Optuna storage guard: resolved database locations, checked before any MLflow run exists."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from studies.ablation.ablate import ablate
from studies.ablation.sweep import sweep
from studies.ablation.worker import worker
from studies.runtime.options import check_storage_option
from tracking.store.storage_guard import location

ROOT = Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "studies" / "protocols" / "smoke.yaml")


def test_locations_are_resolved_not_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert location("sqlite:///runs.db") == location(f"sqlite:///{tmp_path}/runs.db") == \
        location(f"sqlite:///{tmp_path}/sub/../runs.db") == ("file", str(tmp_path / "runs.db"))
    assert location("sqlite:///runs.db") != location("sqlite:///optuna.db")
    assert location(f"journal:{tmp_path}/runs.db") == location("sqlite:///runs.db")
    assert location("postgresql://mlflow:pw@localhost/mlflow") == \
        location("postgresql+psycopg://optuna@127.0.0.1:5432/mlflow") == ("postgresql", "loopback", 5432, "mlflow")
    assert location("postgresql://127.0.0.1:5433/mlflow") != location("postgresql://127.0.0.1/mlflow")
    assert location("postgresql://db.example.org/mlflow") != location("postgresql://127.0.0.1/mlflow")
    for nothing in ("sqlite://", "sqlite:///:memory:", "http://127.0.0.1:5000", "file:///tmp/mlruns", "./mlruns"):
        assert location(nothing) is None, nothing


def test_the_guard_checks_the_tracking_store_the_fallback_and_the_servers_databases(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/runs.db")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    monkeypatch.setenv("WORKBENCH_SERVER_BACKEND_URI", "postgresql://mlflow:db-secret-77@localhost/mlflow")
    for clash, what in (("sqlite:///runs.db", "the MLflow tracking store"),
                        (f"sqlite:///{tmp_path}/offline/mlflow.db", "the local fallback store"),
                        ("postgresql://optuna:x@127.0.0.1:5432/mlflow", "WORKBENCH_SERVER_BACKEND_URI")):
        with pytest.raises(click.BadParameter, match=what) as caught:
            check_storage_option(clash)
        assert "db-secret-77" not in caught.value.format_message()
    for fine in ("sqlite:///optuna.db", "postgresql://optuna@127.0.0.1:5432/optuna", "journal:queue.log"):
        check_storage_option(fine)


@pytest.mark.parametrize("command, args", [
    (ablate, ["--protocol", SMOKE, "--allow-dirty"]),
    (worker, []),
    (sweep, ["--protocol", SMOKE, "--param", "optim.lr=float:1e-4:1e-2:log"]),
])
def test_entry_points_refuse_mlflows_database_in_one_line_before_any_run(command, args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "runs.db"  # no "mlflow" in the name: the old check let this through
    store.touch()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///runs.db")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    result = CliRunner().invoke(command, [*args, "--storage", f"sqlite:///{store}"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "the MLflow tracking store" in lines[0] and "--storage" in lines[0], result.output
    assert "Traceback" not in result.output
    assert store.stat().st_size == 0, "something was written into MLflow's database"
    assert not (tmp_path / "offline").exists()
