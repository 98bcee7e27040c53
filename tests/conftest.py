"""Shared test setup: CPU only, few threads, every MLflow store inside tmp_path."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A real local MLflow store (SQLite + artifact folder) that the code under test uses."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)  # default artifact root ./mlruns lands in tmp_path
    import mlflow

    mlflow.set_tracking_uri(uri)
    yield uri
    while mlflow.active_run():
        mlflow.end_run()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    """Fail with the max difference shown, so a failure says by how much."""
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
    assert diff <= atol, f"{what}: max |difference| {diff:.3g} > tolerance {atol:g}"
