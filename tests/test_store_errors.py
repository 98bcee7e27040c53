"""A store that cannot be written or read is named in one line; --debug shows every traceback.

The MLflow store (``MLFLOW_TRACKING_URI``) is checked before any run opens: a file that is
not SQLite and a read-only store are refused naming them. A store that turns read-only or
fills up mid-run is explained from SQLite's own phrase, naming the store, without the
INSERT statement MLflow's message carries.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from click.testing import CliRunner

from cli_errors import one_error_problems
from studies.cli import main, one_line
from test_bad_input import PROTOCOLS, TINY_TRAIN, workdir  # noqa: F401  (workdir is a fixture)


def test_a_tracking_store_that_is_not_sqlite_is_named(workdir, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///notdb.db")
    result = CliRunner().invoke(main, ["status", "--protocol", str(PROTOCOLS / "smoke.yaml")])
    problems = one_error_problems(result, "MLFLOW_TRACKING_URI=sqlite:///notdb.db")
    assert not problems and "not an SQLite database" in result.output, (
        f"{problems}\n{result.output[-1500:]}"
    )


def test_debug_shows_the_traceback_of_every_kind_of_error(workdir):
    for args in (
        ["equivalence", "--model", "no_such_model"],  # a command's own ClickException
        ["benchmark-loader", "--n-images", "0"],  # a bad option value
        ["ablate", "--protocol", "binary.yaml"],
    ):  # a library error re-worded by the command
        result = CliRunner().invoke(main, ["--debug", *args])
        assert result.exit_code != 0 and "Traceback (most recent call last)" in result.output, (
            args,
            result.output,
        )


def test_store_errors_are_one_line_naming_the_store(mlflow_store):
    """SQLite's read-only and disk-full errors, wrapped as MLflow wraps them, name the store."""
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    for phrase, says in (
        ("attempt to write a readonly database", "is read-only"),
        ("database or disk is full", "no space left on device"),
    ):
        try:
            try:
                raise sqlalchemy.exc.OperationalError(
                    "INSERT INTO runs ...", {}, sqlite3.OperationalError(phrase)
                )
            except sqlalchemy.exc.OperationalError as err:
                raise MlflowException(err) from err
        except MlflowException as err:
            line = one_line(err)
        assert (
            line.startswith(f"the MLflow store {mlflow_store} ") and says in line and phrase in line
        ), line
        assert "INSERT" not in line and "\n" not in line, line


def test_a_read_only_store_is_refused_before_any_run(workdir, monkeypatch):
    from tracking.store import storage_guard

    real = os.access
    monkeypatch.setattr(
        storage_guard.os,
        "access",
        lambda path, mode: False if Path(path).name == "mlflow.db" else real(path, mode),
    )
    result = CliRunner().invoke(main, [*TINY_TRAIN, "--data-path", "two"])
    problems = one_error_problems(result, "mlflow.db is read-only")
    assert not problems, f"{problems}\n{result.output[-1500:]}"
