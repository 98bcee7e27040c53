"""No secret on a command line: URLs with credentials from the environment, a warning for one typed in argv,
and the allow-listed environments of the processes the workbench starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from servers import free_port
from studies.cli import main
from studies.runtime.secret_options import has_password, worker_hint
from tracking.server import server_config
from tracking.server.server_process import RUNTIME_ENV
from tracking.store.child_env import server_env, watchdog_env, worker_env

SECRET = "Typed-Secret-31"


def test_has_password_sees_userinfo_and_secret_query_parameters_only():
    assert has_password(f"postgresql://u:{SECRET}@db/optuna") and has_password(
        f"https://a:{SECRET}@mlflow.example"
    )
    assert has_password("postgresql://db/optuna?password=x")
    for none in (
        "postgresql://u@db/optuna",
        "sqlite:///q.db",
        "journal:/shared/q.log",
        "http://127.0.0.1:5000",
    ):
        assert not has_password(none), none


@pytest.mark.parametrize(
    "args, option",
    [
        (
            ["worker", "--storage", f"postgresql://optuna:{SECRET}@127.0.0.1:{free_port()}/optuna"],
            "--storage",
        ),
        (["sync", "--to", f"http://alice:{SECRET}@127.0.0.1:{free_port()}"], "--to"),
        (
            [
                "server",
                "grant",
                "bob",
                "exp",
                "--tracking-uri",
                f"http://admin:{SECRET}@127.0.0.1:{free_port()}",
            ],
            "--tracking-uri",
        ),
    ],
)
def test_a_password_typed_on_the_command_line_gets_one_redacted_warning(
    args, option, tmp_path, monkeypatch
):
    from studies.runtime import secret_options

    # once per process: this test's command is a process
    monkeypatch.setattr(secret_options, "_warned", set())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    (tmp_path / "offline").mkdir()
    (tmp_path / "offline" / "mlflow.db").touch()  # sync has something to copy from
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, "an-admin-Passw0rd")
    monkeypatch.setenv("WORKBENCH_HEALTH_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # nothing listens: no retries
    result = CliRunner().invoke(main, args)
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert (
        len(warnings) == 1
        and warnings[0].startswith(f"warning: {option} ")
        and "://***@127.0.0.1:" in warnings[0]
        and "`ps` shows it to every user" in warnings[0]
    ), result.output
    assert SECRET not in result.output
    assert result.exit_code != 0  # nothing listens there: one error line after the warning
    assert "Traceback" not in result.output


def test_the_storage_comes_from_a_named_variable_or_workbench_storage_with_no_warning(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MY_QUEUE", "notascheme://queue")
    result = CliRunner().invoke(main, ["worker", "--storage-env", "MY_QUEUE"])
    assert (
        result.exit_code == 2 and "'notascheme'" in result.output and "warning" not in result.output
    ), result.output
    monkeypatch.setenv(
        "WORKBENCH_STORAGE", f"postgresql://optuna:{SECRET}@127.0.0.1:{free_port()}/optuna"
    )
    result = CliRunner().invoke(main, ["worker"])
    assert result.exit_code == 2 and "cannot look into this database" in result.output, (
        result.output
    )
    assert "warning" not in result.output and SECRET not in result.output
    result = CliRunner().invoke(main, ["worker", "--storage-env", "UNSET_QUEUE_VARIABLE"])
    assert (
        result.exit_code == 2 and "the variable UNSET_QUEUE_VARIABLE is not set" in result.output
    ), result.output
    result = CliRunner().invoke(
        main, ["worker", "--storage", "sqlite:///q.db", "--storage-env", "MY_QUEUE"]
    )
    assert result.exit_code == 2 and "give --storage or --storage-env, not both" in result.output, (
        result.output
    )
    monkeypatch.delenv("WORKBENCH_STORAGE")
    result = CliRunner().invoke(main, ["worker"])
    assert result.exit_code == 2 and "no Optuna storage: set WORKBENCH_STORAGE" in result.output, (
        result.output
    )
    assert not (tmp_path / "q.db").exists()


def test_ablate_does_not_queue_because_workbench_storage_is_exported(tmp_path, monkeypatch):
    """The variable is the worker's; ablate queues only when told on its command line."""
    from studies.ablation.ablate import ablate

    storage = next(p for p in ablate.params if p.name == "storage")
    assert storage.envvar is None
    assert any(p.name == "storage_env" for p in ablate.params)


def test_the_printed_worker_command_keeps_the_url_out_of_argv_and_the_password_off_the_console():
    line = worker_hint(f"postgresql://optuna:{SECRET}@db.example/optuna", "cells:smoke@abc")
    assert SECRET not in line and "postgresql://***@db.example/optuna" in line, line
    assert line.splitlines()[-1] == "  workbench worker --study cells:smoke@abc", line
    line = worker_hint("postgresql://optuna@db.example/optuna", "cells:smoke@abc")
    assert (
        line.splitlines()[-1]
        == "  WORKBENCH_STORAGE=postgresql://optuna@db.example/optuna workbench worker "
        "--study cells:smoke@abc"
        and "PGPASSWORD or ~/.pgpass" in line
    ), line


ENVIRON = {
    "PATH": "/usr/bin",
    "HOME": "/home/u",
    "LANG": "C.UTF-8",
    "LC_ALL": "C",
    "PYTHONPATH": "/src",
    "DBPASS": "unrelated-31",
    "GITHUB_TOKEN": "ghp-31",
    "PGPASSWORD": "pg-31",
    "PGPASSFILE": "/home/u/.pgpass",
    "MLFLOW_TRACKING_URI": "https://mlflow.example",
    "MLFLOW_TRACKING_PASSWORD": "acct-31",
    "WORKBENCH_OFFLINE_DIR": "/o",
    "WORKBENCH_SERVER_ADMIN_PASSWORD": "admin-31",
    "WORKBENCH_SERVER_BACKEND_URI": "postgresql://m:db-31@h/mlflow",
    "MLFLOW_FLASK_SERVER_SECRET_KEY": "k-31",
    "AWS_SECRET_ACCESS_KEY": "aws-31",
    "CUDA_VISIBLE_DEVICES": "0",
    "OMP_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def test_children_get_what_they_need_and_nothing_else():
    worker = worker_env(ENVIRON)
    assert set(worker) == {
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "PYTHONPATH",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_TRACKING_PASSWORD",
        "WORKBENCH_OFFLINE_DIR",
        "AWS_SECRET_ACCESS_KEY",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        # the kernel caps reach every job: its cells run the kernels the coordinator was capped to
        "ATEN_CPU_CAPABILITY",
        "ONEDNN_MAX_CPU_ISA",
        "MKL_ENABLE_INSTRUCTIONS",
    }, sorted(worker)
    # libpq's settings only where a PostgreSQL database is used: the queue, or the tracking store.
    queue = "postgresql://optuna@db.example/optuna"
    assert set(worker_env(ENVIRON, storage=queue)) - set(worker) == {"PGPASSWORD", "PGPASSFILE"}
    on_pg = {**ENVIRON, "MLFLOW_TRACKING_URI": "postgresql+psycopg2://m@db/mlflow"}
    assert {"PGPASSWORD", "PGPASSFILE"} <= set(worker_env(on_pg))
    server = server_env(ENVIRON)
    assert set(server) == {
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "PYTHONPATH",
        "MLFLOW_FLASK_SERVER_SECRET_KEY",
        "AWS_SECRET_ACCESS_KEY",
    }, sorted(server)
    assert set(watchdog_env(ENVIRON)) == {"PATH", "HOME", "LANG", "LC_ALL"}


def test_a_worker_gets_the_workbench_variables_it_reads_by_name_and_no_queue_url(monkeypatch):
    """A variable the coordinator's shell holds a queue URL in (``--storage-env WORKBENCH_QUEUE_URL``)
    is no worker's business: its queue comes as WORKBENCH_STORAGE only."""
    from studies.ablation.jobs import worker_environment

    queue = f"postgresql://optuna:{SECRET}@db.example/optuna"
    environ = {
        **ENVIRON,
        "WORKBENCH_QUEUE_URL": queue,
        "WORKBENCH_ANYTHING_ELSE": "x",
        "WORKBENCH_DATA_DIR": "/d",
        "WORKBENCH_CACHE_DIR": "/c",
        "WORKBENCH_USER": "ana",
        "WORKBENCH_DEBUG": "1",
        "WORKBENCH_LEASE_SECONDS": "60",
    }
    worker = worker_env(environ)
    assert {k for k in worker if k.startswith("WORKBENCH_")} == {
        "WORKBENCH_OFFLINE_DIR",
        "WORKBENCH_DATA_DIR",
        "WORKBENCH_CACHE_DIR",
        "WORKBENCH_USER",
        "WORKBENCH_DEBUG",
        "WORKBENCH_LEASE_SECONDS",
    }, sorted(worker)
    # Whatever variable the coordinator's URL came from (any name), its value goes nowhere else.
    monkeypatch.setattr("os.environ", {**environ, "MLFLOW_MY_QUEUE": queue})
    env = worker_environment(queue)
    holding = sorted(k for k, v in env.items() if SECRET in v)
    assert holding == ["WORKBENCH_STORAGE"], holding


def test_the_launchers_pgpassword_reaches_the_server_only_in_its_private_pgpass(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(server_config, "ensure_admin", lambda *args: True)  # no users database here
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "run"))
    (tmp_path / ".pgpass").write_text("other.example:5432:*:me:mine\n")
    base = {**ENVIRON, "HOME": str(tmp_path), "PGPASSFILE": str(tmp_path / ".pgpass")}
    cfg = server_config.ServerConfig(
        f"postgresql://mlflow@127.0.0.1:{free_port()}/mlflow",
        str(tmp_path / "art"),
        auth_database_uri=f"postgresql://mlflow@127.0.0.1:{free_port()}/mlflow_auth",
    )
    with server_config.prepared_server(cfg, "admin", "an-admin-Passw0rd", base_env=base) as (
        cmd,
        env,
    ):
        lines = Path(env["PGPASSFILE"]).read_text().splitlines()
        assert [line.split(":")[2:] for line in lines[:2]] == [
            ["mlflow", "mlflow", "pg-31"],
            ["mlflow_auth", "mlflow", "pg-31"],
        ], lines
        assert lines[2:] == ["other.example:5432:*:me:mine"], (
            "the launcher's own password file follows"
        )
        for secret in ("pg-31", "unrelated-31", "ghp-31", "acct-31", "admin-31", "db-31"):
            assert not any(secret in v for v in env.values()), secret
            assert not any(secret in a for a in cmd), secret
