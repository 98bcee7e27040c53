"""The Optuna storage guard: resolved database locations, checked before any MLflow run exists."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from studies.ablation.ablate import ablate
from studies.ablation.sweep import sweep
from studies.ablation.worker import worker
from servers import free_port, postgres_server
from studies.runtime.options import check_storage_option
from tracking.store.storage_guard import location

ROOT = Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "studies" / "protocols" / "smoke.yaml")


def test_locations_are_resolved_not_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (
        location("sqlite:///runs.db")
        == location(f"sqlite:///{tmp_path}/runs.db")
        == location(f"sqlite:///{tmp_path}/sub/../runs.db")
        == ("file", str(tmp_path / "runs.db"))
    )
    assert location("sqlite:///runs.db") != location("sqlite:///optuna.db")
    assert location(f"journal:{tmp_path}/runs.db") == location("sqlite:///runs.db")
    assert (
        location("postgresql://mlflow:pw@localhost/mlflow")
        == location("postgresql+psycopg://optuna@127.0.0.1:5432/mlflow")
        == ("postgresql", "loopback", 5432, "mlflow")
    )
    assert location("postgresql://127.0.0.1:5433/mlflow") != location(
        "postgresql://127.0.0.1/mlflow"
    )
    assert location("postgresql://db.example.org/mlflow") != location(
        "postgresql://127.0.0.1/mlflow"
    )
    for nothing in (
        "sqlite://",
        "sqlite:///:memory:",
        "http://127.0.0.1:5000",
        "file:///tmp/mlruns",
        "./mlruns",
    ):
        assert location(nothing) is None, nothing


def test_the_guard_checks_the_tracking_store_the_fallback_and_the_servers_databases(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/runs.db")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    monkeypatch.setenv(
        "WORKBENCH_SERVER_BACKEND_URI", "postgresql://mlflow:db-secret-77@localhost/mlflow"
    )
    for clash, what in (
        ("sqlite:///runs.db", "the MLflow tracking store"),
        (f"sqlite:///{tmp_path}/offline/mlflow.db", "the local fallback store"),
        ("postgresql://optuna:x@127.0.0.1:5432/mlflow", "WORKBENCH_SERVER_BACKEND_URI"),
    ):
        with pytest.raises(click.BadParameter, match=what) as caught:
            check_storage_option(clash)
        assert "db-secret-77" not in caught.value.format_message()
    for fine in ("sqlite:///optuna.db", "journal:queue.log"):
        check_storage_option(fine)
    with pytest.raises(
        click.BadParameter
    ) as caught:  # a database it cannot look into: one line, named
        check_storage_option(f"postgresql://optuna:db-secret-77@127.0.0.1:{free_port()}/optuna")
    message = caught.value.format_message()
    assert (
        "cannot look into this database" in message and "postgresql://***@127.0.0.1:" in message
    ), message
    assert "db-secret-77" not in message and "\n" not in message


@pytest.mark.parametrize(
    "command, args",
    [
        (ablate, ["--protocol", SMOKE, "--allow-dirty"]),
        (worker, []),
        (sweep, ["--protocol", SMOKE, "--param", "optim.lr=float:1e-4:1e-2:log"]),
    ],
)
def test_entry_points_refuse_mlflows_database_in_one_line_before_any_run(
    command, args, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "runs.db"  # no "mlflow" in the name: the old check let this through
    store.touch()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///runs.db")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    result = CliRunner().invoke(command, [*args, "--storage", f"sqlite:///{store}"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert (
        len(lines) == 1 and "the MLflow tracking store" in lines[0] and "--storage" in lines[0]
    ), result.output
    assert "Traceback" not in result.output
    assert store.stat().st_size == 0, "something was written into MLflow's database"
    assert not (tmp_path / "offline").exists()


# ---------------------------------------------------------------- looking inside the database


def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return {r[0] for r in db.execute("select name from sqlite_master where type = 'table'")}


def _optuna_sqlite(path: Path) -> Path:
    import optuna

    optuna.create_study(storage=f"sqlite:///{path}", study_name="someone-elses")
    return path


@pytest.mark.parametrize(
    "command",
    [
        ["ablate", "--protocol", SMOKE, "--allow-dirty"],
        ["worker"],
        ["sweep", "--protocol", SMOKE, "--param", "optim.lr=float:1e-4:1e-2:log"],
    ],
)
def test_a_storage_holding_mlflows_tables_is_refused_from_a_machine_that_knows_nothing_of_it(
    command, empty_mlflow_db, tmp_path, monkeypatch
):
    """A client with none of the server's settings: only the database itself says it is MLflow's."""
    from studies.cli import main

    monkeypatch.chdir(tmp_path)
    team = tmp_path / "team-runs.db"  # another machine's MLflow store, by a name that says nothing
    shutil.copyfile(empty_mlflow_db, team)
    before = team.read_bytes()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/local.db")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    for env in ("WORKBENCH_SERVER_BACKEND_URI", "WORKBENCH_SERVER_AUTH_DB_URI"):
        monkeypatch.delenv(env, raising=False)
    result = CliRunner().invoke(main, [*command, "--storage", f"sqlite:///{team}"])
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()][-1:]
    assert (
        f"sqlite:///{team} is one of MLflow's databases (it holds experiments, runs, alembic_version at "
        "MLflow's revision"
        in line
        and "--storage" in line
        and "nothing was created" in line
    ), result.output
    assert "Traceback" not in result.output
    assert team.read_bytes() == before, "Optuna wrote into MLflow's database"
    assert not (tmp_path / "local.db").exists() and not (tmp_path / "offline").exists(), (
        "a run was opened"
    )


def test_an_optuna_storage_is_refused_as_mlflows_tracking_store_before_mlflow_writes(
    tmp_path, monkeypatch
):
    from studies.cli import main

    monkeypatch.chdir(tmp_path)
    queue = _optuna_sqlite(tmp_path / "queue.db")
    before = _tables(queue)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{queue}")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    result = CliRunner().invoke(main, ["ablate", "--protocol", SMOKE, "--allow-dirty"])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: MLFLOW_TRACKING_URI=sqlite:///{queue} is an Optuna storage (it holds studies, trials, version_info, "
        "alembic_version at Optuna's revision v3.2.0.a); MLflow would write its tables into it and break both. "
        "Give MLflow a database of its own; nothing was created"
    ], result.output
    assert _tables(queue) == before, "MLflow created tables in Optuna's database"


def test_a_journal_file_that_is_an_sqlite_database_is_refused(tmp_path, empty_mlflow_db):
    team = tmp_path / "runs.db"
    shutil.copyfile(empty_mlflow_db, team)
    with pytest.raises(
        click.BadParameter, match="is an SQLite database, not an Optuna journal file"
    ):
        check_storage_option(f"journal:{team}")
    assert team.read_bytes() == empty_mlflow_db.read_bytes()


def test_looking_inside_creates_nothing(tmp_path):
    from tracking.store.storage_guard import look_inside

    assert (
        look_inside(f"sqlite:///{tmp_path}/new.db") is None and not (tmp_path / "new.db").exists()
    )
    (tmp_path / "empty.db").touch()
    assert look_inside(f"sqlite:///{tmp_path}/empty.db") is None
    assert (
        look_inside(f"journal:{tmp_path}/q.log") is None
        and look_inside("http://127.0.0.1:5000") is None
    )


PG_SECRET = "pg-Secret-in-no-argv-31"


def _pg_tables(url: str) -> set[str]:
    from sqlalchemy import create_engine, inspect

    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.slow  # PostgreSQL, MLflow's migrations on it and an ablate subprocess: about 45 s on 2 busy cores
@pytest.mark.integration
def test_on_postgresql_each_tool_is_refused_the_others_database_and_no_password_is_in_any_argv(
    tmp_path, monkeypatch
):
    """PostgreSQL with passwords (scram-sha-256), a client with none of the server's settings.

    MLflow's database as Optuna's storage: refused, nothing created, no run opened. Then the
    cells are queued into Optuna's own database with the passworded URL given in a variable
    (``--storage-env``) while every process's argv is sampled: the password is in none.
    Then Optuna's database as MLflow's store: refused, no MLflow table in it.
    """
    from mlflow.tracking import MlflowClient

    from sampler import ArgvSampler
    from studies.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    for env in ("WORKBENCH_SERVER_BACKEND_URI", "WORKBENCH_SERVER_AUTH_DB_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(env, raising=False)
    with postgres_server(("mlflow", "optuna"), password=PG_SECRET) as pg:
        with_password = pg.replace("postgres@", f"postgres:{PG_SECRET}@")
        MlflowClient(
            f"{with_password}/mlflow"
        ).search_experiments()  # MLflow's schema, as a server makes it
        mlflow_tables = _pg_tables(f"{with_password}/mlflow")
        assert {"experiments", "runs", "alembic_version"} <= mlflow_tables

        # 1. A URL without a password, the password from PGPASSWORD (libpq's own rule).
        monkeypatch.setenv("PGPASSWORD", PG_SECRET)
        monkeypatch.setenv("QUEUE_URL", f"{pg}/mlflow")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/local.db")
        refused = CliRunner().invoke(
            main, ["ablate", "--protocol", SMOKE, "--allow-dirty", "--storage-env", "QUEUE_URL"]
        )
        assert refused.exit_code == 2, refused.output
        assert (
            f"postgresql://***@{pg.split('@')[1]}/mlflow is one of MLflow's databases (it holds experiments, runs, "
            "alembic_version at MLflow's revision" in refused.output
        ), refused.output
        assert PG_SECRET not in refused.output and "Traceback" not in refused.output
        assert _pg_tables(f"{with_password}/mlflow") == mlflow_tables, (
            "Optuna created tables in MLflow's database"
        )
        assert not (tmp_path / "local.db").exists(), "a run was opened"
        monkeypatch.delenv("PGPASSWORD")

        # 2. Queue into Optuna's own database: the passworded URL travels in a variable only.
        env = {**os.environ, "QUEUE_URL": f"{with_password}/optuna", "PYTHONPATH": str(ROOT)}
        command = [
            sys.executable,
            "-m",
            "studies.cli",
            "ablate",
            "--protocol",
            SMOKE,
            "--allow-dirty",
            "--storage-env",
            "QUEUE_URL",
        ]
        with ArgvSampler(PG_SECRET) as sampler:
            done = subprocess.run(
                command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "queued 4 cells in cells:smoke@" in out, out[-3000:]
        assert (
            "workbench worker --storage-env QUEUE_URL --study cells:smoke@" in out
            and PG_SECRET not in out
        ), out
        assert "[I " not in out, "Optuna's INFO lines on the console"
        sampler.check(seen="ablate")
        assert {"studies", "trials", "version_info"} <= _pg_tables(f"{with_password}/optuna")

        # 3. Optuna's database as MLflow's tracking store: refused before MLflow creates a table.
        optuna_tables = _pg_tables(f"{with_password}/optuna")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"{with_password}/optuna")
        refused = CliRunner().invoke(main, ["ablate", "--protocol", SMOKE, "--allow-dirty"])
        assert (
            refused.exit_code == 1 and "MLFLOW_TRACKING_URI=postgresql://***@" in refused.output
        ), refused.output
        assert (
            "/optuna is an Optuna storage (it holds studies, trials, version_info" in refused.output
        ), refused.output
        assert PG_SECRET not in refused.output
        assert _pg_tables(f"{with_password}/optuna") == optuna_tables, (
            "MLflow created tables in Optuna's database"
        )


def test_libpqs_login_advice_fits_the_url_it_was_given(monkeypatch):
    """ "Leave the password out of the URL" only for a URL that holds one; for one without, where
    libpq looked (its .pgpass lines match the host as written: localhost is not 127.0.0.1)."""
    from tracking.store import storage_guard
    from tracking.store.storage_guard import StorageClash, look_inside

    def refused(url):
        raise RuntimeError(
            'connection to server at "127.0.0.1", port 5432 failed: fe_sendauth: no password supplied'
        )

    monkeypatch.setattr(storage_guard, "_server_schema", refused)
    monkeypatch.delenv("PGPASSFILE", raising=False)
    with pytest.raises(StorageClash) as info:
        look_inside("postgresql://optuna@127.0.0.1:5432/optuna")
    message = str(info.value)
    assert "leave the password out" not in message and "\n" not in message, message
    assert "no password in the URL" in message and "127.0.0.1:5432:optuna:optuna" in message, (
        message
    )
    assert "localhost" in message, message
    with pytest.raises(StorageClash) as info:
        look_inside("postgresql://optuna:Secret-40@127.0.0.1:5432/optuna")
    message = str(info.value)
    assert "Secret-40" not in message and "the password in the URL was refused" in message, message
