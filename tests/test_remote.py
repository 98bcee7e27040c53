"""Remote tracking: the server launcher, users, a protocol run over HTTP with basic-auth, refused credentials.

The integration tests start PostgreSQL (runs and users each in a database of their own)
and the server exactly as ``workbench server start`` runs it, on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from servers import Launcher, descendants, free_port, isolated_tracking, postgres_server, running  # noqa: F401
from studies.ablation.ablate import ablate
from studies.cli import main
from studies.tools.server import server as server_command
from studies.tools.sync import sync as sync_command
from tracking.server import server_config, server_process, server_users
from tracking.server.server_process import RUNTIME_ENV
from tracking.store import health, offline_store, uris

ROOT = Path(__file__).resolve().parent.parent
ADMIN = ("admin", "remote-admin-Passw0rd")
WORKER = ("worker", "colab-worker-Passw0rd")
ALICE = ("alice", "alice-owns-Passw0rd")
BOB = ("bob", "bob-reads-Passw0rd")
CAROL = ("carol", "carol-owns-Passw0rd")  # owns an experiment; dave collaborates on it
DAVE = ("dave", "dave-helps-Passw0rd")
PROTOCOL = """\
name: remote
description: one arm, two seeds, logged over HTTP
dataset: {name: image_folder, val_size: 6, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}
optim: {lr: 0.003}
run: {epochs: 2, batch_size: 8, evaluate_test: true}
arms:
  - {name: vit, reference: true}
seeds: [0, 1]
"""


# ---------------------------------------------------------------- no server needed


@pytest.mark.parametrize(
    "user, password, error",
    [
        ("admin", None, "set WORKBENCH_SERVER_ADMIN_PASSWORD"),
        ("admin", "password1234", "published default"),
        ("admin", "short-pw", "shorter than 12"),
        ("adminadmin12", "adminadmin12", "derived from the user name"),
        (None, "a-fine-password-1", "set WORKBENCH_SERVER_ADMIN_USER"),
    ],
)
def test_the_launcher_refuses_missing_default_or_weak_admin_passwords(
    user, password, error, tmp_path
):
    cfg = server_config.ServerConfig("sqlite:///x.db", str(tmp_path))
    with pytest.raises(server_config.ServerConfigError, match=error):
        with server_config.prepared_server(cfg, user, password):
            pass


def test_server_start_refuses_the_default_password_before_starting_anything(monkeypatch, tmp_path):
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, "password1234")
    result = CliRunner().invoke(
        server_command,
        [
            "start",
            "--backend-store-uri",
            f"sqlite:///{tmp_path}/m.db",
            "--artifacts-destination",
            str(tmp_path / "a"),
        ],
    )
    assert result.exit_code == 1 and "published default" in result.output, result.output
    assert "password1234" not in result.output
    assert not (tmp_path / "m.db").exists()


def test_server_environment_keeps_secrets_off_the_command_line_and_the_ini_private(
    tmp_path, monkeypatch
):
    created = []
    # no users database here
    monkeypatch.setattr(server_config, "ensure_admin", lambda *args: created.append(args) or True)
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "run"))
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    cfg = server_config.ServerConfig(
        "postgresql://mlflow:db-secret-99@127.0.0.1/mlflow",
        str(tmp_path / "art"),
        port=5099,
        allowed_hosts="mlflow.example.org",
        cors_allowed_origins="https://mlflow.example.org",
        auth_database_uri="postgresql://mlflow:db-secret-99@127.0.0.1:5433/mlflow_auth",
    )
    with server_config.prepared_server(cfg, *ADMIN) as (cmd, env):
        ini = Path(env["MLFLOW_AUTH_CONFIG_PATH"])
        folder = ini.parent
        assert (
            stat.S_IMODE(folder.stat().st_mode) == 0o700
            and stat.S_IMODE(ini.stat().st_mode) == 0o600
        )
        text = ini.read_text()
        assert "admin_username = admin" in text and "default_permission = READ" in text
        assert "database_uri = postgresql://mlflow@127.0.0.1:5433/mlflow_auth" in text
        assert Path(env["PGPASSFILE"]).read_text() == (
            "127.0.0.1:5432:mlflow:mlflow:db-secret-99\n"
            "127.0.0.1:5433:mlflow_auth:mlflow:db-secret-99\n"
        )
        assert stat.S_IMODE(Path(env["PGPASSFILE"]).stat().st_mode) == 0o600
        for secret in ("db-secret-99", ADMIN[1]):
            assert not any(secret in a for a in cmd), cmd
            assert not any(secret in v for v in env.values()), (
                f"{secret} in the server's environment"
            )
            assert secret not in text
        assert env["MLFLOW_BACKEND_STORE_URI"] == "postgresql://mlflow@127.0.0.1/mlflow"
        assert created == [(cfg.auth_database_uri, *ADMIN)], (
            "the launcher creates the admin, not the server"
        )
        for flag, value in (
            ("--app-name", "basic-auth"),
            ("--allowed-hosts", "mlflow.example.org"),
            ("--cors-allowed-origins", "https://mlflow.example.org"),
            ("--port", "5099"),
        ):
            assert cmd[cmd.index(flag) + 1] == value
        assert "--serve-artifacts" in cmd and cmd[cmd.index("--artifacts-destination") + 1] == str(
            tmp_path / "art"
        )
    assert not folder.exists(), "the runtime folder outlives the server"
    assert "db-secret-99" not in server_config.describe(cfg)


def test_pgpass_lines_escape_and_other_uris_pass_through():
    assert server_config.split_password(
        "postgresql+psycopg://u:p%3Aw%5Cd@db.example.org:6543/runs"
    ) == (
        "postgresql+psycopg://u@db.example.org:6543/runs",
        "db.example.org:6543:runs:u:p\\:w\\\\d",
    )
    assert server_config.split_password("postgresql://u@h/db") == ("postgresql://u@h/db", None)
    assert server_config.split_password("sqlite:///x.db") == ("sqlite:///x.db", None)


def test_server_start_on_a_port_in_use_exits_1_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "run"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(
            server_command,
            [
                "start",
                "--backend-store-uri",
                f"sqlite:///{tmp_path}/m.db",
                "--artifacts-destination",
                str(tmp_path / "a"),
                "--port",
                str(port),
            ],
        )
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port}: already in use; "
        "stop what runs there or pass --port"
    ]
    assert not (tmp_path / "m.db").exists() and not list((tmp_path / "run").glob("launch-*"))


def test_runtime_folders_of_dead_launchers_are_removed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "run"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = server_process.runtime_root() / f"launch-{dead.pid}"
    stale.mkdir()
    (stale / "basic_auth.ini").write_text("left by a launcher that died")
    alive = server_process.runtime_root() / f"launch-{os.getppid()}"
    alive.mkdir()
    folder = server_process.new_runtime_dir()
    assert not stale.exists() and alive.exists() and folder.exists()
    assert stat.S_IMODE(server_process.runtime_root().stat().st_mode) == 0o700


def test_protocol_record_survives_a_rename_of_its_experiment(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from tracking.record.protocol_runs import (
        ProtocolRecordError,
        experiment_id_for,
        recorded_hashes,
    )

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'runs.db'}")
    exp_id = experiment_id_for("frozen")
    client = MlflowClient()
    client.create_run(
        exp_id, tags={"protocol_name": "frozen", "protocol_hash": "abc123", "parent": "true"}
    )
    client.rename_experiment(exp_id, "frozen (old results)")
    assert experiment_id_for("frozen") == exp_id and recorded_hashes("frozen") == {"abc123"}
    assert client.get_experiment_by_name("frozen") is None, "a second experiment was created"
    other = client.create_experiment("frozen")  # someone starts it again by name, elsewhere
    assert experiment_id_for("frozen") == exp_id, (
        "an empty experiment of the same name took over the record"
    )
    client.create_run(
        other, tags={"protocol_name": "frozen", "protocol_hash": "def456", "parent": "true"}
    )
    assert experiment_id_for("frozen") == other  # found by name first: the usual case, one query
    client.delete_experiment(other)
    client.create_experiment("frozen-copy")
    client.create_run(
        client.get_experiment_by_name("frozen-copy").experiment_id,
        tags={"protocol_name": "frozen", "protocol_hash": "abc123", "parent": "true"},
    )
    with pytest.raises(
        ProtocolRecordError, match="are in 2 experiments: 'frozen \\(old results\\)'"
    ):
        experiment_id_for("frozen")


def test_uris_and_values_are_redacted(monkeypatch):
    assert (
        uris.redact_uri("https://bob:s3cret@mlflow.example.org/x")
        == "https://***@mlflow.example.org/x"
    )
    assert (
        uris.redact_uri("postgresql://u:p@h:5432/db and http://h/p?a=b@c")
        == "postgresql://***@h:5432/db and http://h/p?a=b@c"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-value")
    assert uris.scrub("token s3cret-value and bob:s3cret-value") == "token *** and ***"


def test_an_error_line_shows_no_credential():
    from studies.cli import one_line

    err = MlflowException(
        "API request to http://dave:s3cret-pw@h:5000/api/2.0/mlflow/runs/get failed with exception x"
    )
    assert (
        one_line(err)
        == "API request to http://***@h:5000/api/2.0/mlflow/runs/get failed with exception x"
    )


def test_unreachable_and_refused_are_told_apart():
    import requests
    from mlflow.utils.rest_utils import verify_rest_response

    def wrapped(
        inner,
    ):  # how MLflow reports a failed request: a new exception, the original as context
        try:
            raise inner
        except Exception:
            try:
                raise MlflowException("API request to http://h/api failed with exception boom")
            except MlflowException as err:
                return err

    def answered(status: int, body: bytes):  # how MLflow reports an HTTP error answer
        response = requests.Response()
        response.status_code, response._content = status, body
        with pytest.raises(MlflowException) as caught:
            verify_rest_response(response, "/api/2.0/mlflow/runs/log-batch")
        return caught.value

    assert health.is_unreachable(wrapped(requests.exceptions.ConnectionError("refused")))
    assert health.is_unreachable(answered(502, b"Bad Gateway"))  # a tunnel whose server is down
    refused = answered(401, b"You are not authenticated.")
    assert health.is_auth_failure(refused) and not health.is_unreachable(refused)
    mlflow_said_no = answered(
        400, b'{"error_code": "INVALID_PARAMETER_VALUE", "message": "Changing param values"}'
    )
    assert not health.is_unreachable(mlflow_said_no) and not health.is_auth_failure(mlflow_said_no)


def test_grants_are_the_permissions_mlflow_accepts_on_an_experiment():
    from mlflow.server.auth.permissions import RESOURCE_GRANTABLE_PERMISSIONS

    assert set(server_users.GRANT_PERMISSIONS) == RESOURCE_GRANTABLE_PERMISSIONS


def test_grant_refuses_no_permissions_in_one_line_before_asking_the_server(monkeypatch):
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    result = CliRunner().invoke(
        server_command,
        [
            "grant",
            "bob",
            "study",
            "--permission",
            "NO_PERMISSIONS",
            "--tracking-uri",
            f"http://127.0.0.1:{free_port()}",
        ],
    )
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith(
        "Error: Invalid value for '--permission': 'NO_PERMISSIONS' is not a permission MLflow "
        "grants on an experiment (READ, USE, EDIT, MANAGE, DENY)"
    ), error
    assert "`workbench server revoke USER EXPERIMENT`" in error


def test_run_user_is_the_account_that_logs_in_to_the_server(monkeypatch):
    from tracking.store.session import run_user

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.setenv("WORKBENCH_USER", "someone-local")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///runs.db")
    assert run_user() == "someone-local"
    # a token or no auth: no account known
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.org")
    assert run_user() == "someone-local"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://carol%40lab:pw@mlflow.example.org")
    assert run_user() == "carol@lab"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "worker")  # what MLflow sends when both are set
    assert run_user() == "worker"


def test_an_admin_command_against_a_dead_server_says_one_line(monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    # the workbench's default: 3 (seconds, not minutes)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    result = CliRunner().invoke(server_command, ["revoke", "dave", "study", "--tracking-uri", url])
    lines = result.output.splitlines()  # not MLflow's "INTERNAL_ERROR (HTTP 500)"
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(
        f"Error: could not revoke the grant of 'dave' on 'study': {url} unreachable ("
    ), lines


def test_the_colab_notebook_is_valid_nbformat_4():
    nb = json.loads((ROOT / "notebooks" / "colab_t4.ipynb").read_text())
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int) and "metadata" in nb
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("markdown", "code") and isinstance(cell["source"], (list, str))
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and "execution_count" in cell
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for needed in (
        "userdata.get",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
        "torch.cuda",
        "workbench worker",
        "--device cuda",
        "workbench ablate",
        "workbench sync",
    ):
        assert needed in code, needed
    script = (ROOT / "scripts" / "remote_gpu.sh").read_text()
    for needed in (
        "MLFLOW_TRACKING_URI",
        "export WORKBENCH_STORAGE=",
        "remote_gpu.sh worker ",
        "workbench sync",
        "set -euo pipefail",
    ):
        assert needed in script, needed
    assert "--storage" not in code.replace("--storage-env", ""), (
        "the notebook puts the queue's URL in argv"
    )
    assert "remote_gpu.sh worker --storage" not in script, (
        "the script's usage puts the queue's URL in argv"
    )


# ---------------------------------------------------------------- a real server on PostgreSQL


DB_SECRET = "db-secret-in-the-uri-31"  # PostgreSQL trusts loopback here; it still must never leak
# in the launcher's shell for something else: no child may inherit it
UNRELATED_SECRET = "unrelated-DBPASS-31"


def server_env(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WORKBENCH_"))}
    return {
        **env,
        server_config.ADMIN_USER_ENV: ADMIN[0],
        server_config.ADMIN_PASSWORD_ENV: ADMIN[1],
        RUNTIME_ENV: str(root / "run"),
        "OMP_NUM_THREADS": "1",
        "DBPASS": UNRELATED_SECRET,
    }


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """``workbench server start`` itself (a subprocess) on PostgreSQL; one per module.

    The databases' URIs (with a password) come from the environment, as docs/server.md
    starts it: nothing secret is in the launcher's argv.
    """
    root = tmp_path_factory.mktemp("remote")
    with postgres_server(("mlflow", "mlflow_auth")) as pg:
        pg = pg.replace("postgresql://postgres@", f"postgresql://postgres:{DB_SECRET}@")
        env = {
            **server_env(root),
            server_config.BACKEND_ENV: f"{pg}/mlflow",
            server_config.AUTH_DB_ENV: f"{pg}/mlflow_auth",
        }
        server = Launcher(
            [
                "--artifacts-destination",
                str(root / "artifacts"),
                "--port",
                str(free_port()),
                "--workers",
                "1",
            ],
            env,
            root / "launcher.log",
        )
        server.start()
        try:
            yield server
        finally:
            server.stop()


def as_user(monkeypatch, user: tuple[str, str]) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", user[1])


def http_status(action) -> int | None:
    """The HTTP status an MLflow client call was answered with (None: it succeeded)."""
    import requests

    try:
        action()
    except MlflowException as err:
        return err.get_http_status_code()
    except requests.HTTPError as err:
        return err.response.status_code
    return None


@pytest.mark.integration
@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_the_ready_line_and_no_secret_in_the_servers_environment(auth_server):
    out = auth_server.output()
    ready = [line for line in out.splitlines() if line.startswith("ready: ")]
    assert len(ready) == 1 and auth_server.url in ready[0] and "basic-auth on" in ready[0], out[
        -2000:
    ]
    assert "postgresql://***@127.0.0.1" in ready[0] and "default permission READ" in ready[0]
    assert DB_SECRET not in out and ADMIN[1] not in out
    # neither the launcher's nor the server's
    assert "StarletteDeprecationWarning" not in out, out[:3000]
    assert "warning:" not in out, out[:3000]  # no password on its command line, so no warning
    below = descendants(auth_server.proc.pid)
    assert len(below) >= 2, "no server and watchdog under the launcher"
    commands = []
    for pid in below | {auth_server.proc.pid}:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read()
            commands.append(argv.replace(b"\0", b" ").decode())
        for secret in (DB_SECRET, ADMIN[1], UNRELATED_SECRET):
            assert secret.encode() not in argv, f"a password in the argv of {pid}"
        if pid == auth_server.proc.pid:
            continue  # the launcher was started with them; it passes them to no one
        for secret in (DB_SECRET, ADMIN[1], UNRELATED_SECRET):
            assert secret.encode() not in environ, (
                f"{secret} in the environment of {pid} ({commands[-1][:80]})"
            )
        names = {line.split(b"=", 1)[0].decode() for line in environ.split(b"\0") if b"=" in line}
        assert not names & {
            "DBPASS",
            server_config.BACKEND_ENV,
            server_config.AUTH_DB_ENV,
            "OMP_NUM_THREADS",
        }, (pid, sorted(names))
    # the watchdog was checked too
    assert any("server_watchdog.py" in c for c in commands), commands


@pytest.mark.integration
def test_users_read_every_experiment_and_change_only_their_own(
    auth_server, isolated_tracking, tmp_path, monkeypatch
):
    url = auth_server.url
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv(server_config.ADMIN_USER_ENV, ADMIN[0])
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    runner = CliRunner()
    for user in (ALICE, BOB):
        monkeypatch.setenv("WORKBENCH_NEW_USER_PASSWORD", user[1])
        added = runner.invoke(server_command, ["add-user", user[0]])
        assert added.exit_code == 0, added.output
    again = runner.invoke(server_command, ["add-user", ALICE[0]])
    assert again.exit_code == 1 and again.output.strip().splitlines() == [
        f"Error: user 'alice' already exists on {url}; nothing changed"
    ], again.output

    client = MlflowClient(url)
    as_user(monkeypatch, ALICE)
    exp = client.create_experiment("alice-study")
    run = client.create_run(exp).info.run_id
    client.log_metric(run, "val_accuracy", 0.61, step=1)
    client.set_tag(run, "note", "alice's")
    (tmp_path / "notes.txt").write_text("alice's file")
    client.log_artifact(run, str(tmp_path / "notes.txt"))

    as_user(monkeypatch, BOB)
    (tmp_path / "fake.txt").write_text("bob's file")
    attempts = {
        "log a metric": lambda: client.log_metric(run, "val_accuracy", 0.99, step=2),
        "set a tag": lambda: client.set_tag(run, "note", "bob's"),
        "change the status": lambda: client.set_terminated(run, "KILLED"),
        "upload an artifact": lambda: client.log_artifact(run, str(tmp_path / "fake.txt")),
        "rename the experiment": lambda: client.rename_experiment(exp, "bob-study"),
        "delete the run": lambda: client.delete_run(run),
    }
    answers = {what: http_status(action) for what, action in attempts.items()}
    assert answers == {what: 403 for what in attempts}, answers
    # ... and reads everything.
    seen = client.get_run(run)
    assert seen.data.metrics == {"val_accuracy": 0.61} and seen.data.tags["note"] == "alice's"
    assert seen.info.status == "RUNNING" and client.get_experiment(exp).name == "alice-study"
    assert [a.path for a in client.list_artifacts(run)] == ["notes.txt"]
    assert (
        Path(client.download_artifacts(run, "notes.txt", str(tmp_path))).read_text()
        == "alice's file"
    )

    as_user(monkeypatch, ADMIN)  # the admin lends bob a hand on alice's study
    granted = runner.invoke(
        server_command, ["grant", BOB[0], "alice-study", "--permission", "EDIT"]
    )
    assert (
        granted.exit_code == 0
        and f"bob: EDIT on experiment 'alice-study' (id {exp})" in granted.output
    ), granted.output
    as_user(monkeypatch, BOB)
    assert http_status(lambda: client.log_metric(run, "val_accuracy", 0.65, step=2)) is None
    assert http_status(lambda: client.log_artifact(run, str(tmp_path / "fake.txt"))) is None
    assert [m.value for m in client.get_metric_history(run, "val_accuracy")] == [0.61, 0.65]
    unknown = runner.invoke(server_command, ["grant", BOB[0], "no-such-study"])
    assert unknown.exit_code == 1 and "no experiment 'no-such-study'" in unknown.output, (
        unknown.output
    )


@pytest.mark.integration
@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_a_protocol_runs_over_http_with_auth_and_no_credential_is_logged(
    auth_server, isolated_tracking, tmp_path, monkeypatch, capfd
):
    url = auth_server.url
    monkeypatch.setenv(server_config.ADMIN_USER_ENV, ADMIN[0])
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    monkeypatch.setenv("WORKBENCH_NEW_USER_PASSWORD", WORKER[1])
    added = CliRunner().invoke(server_command, ["add-user", WORKER[0], "--tracking-uri", url])
    assert added.exit_code == 0 and f"created user {WORKER[0]}" in added.output, added.output

    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", WORKER[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", WORKER[1])
    checked = CliRunner().invoke(server_command, ["check"])
    assert checked.exit_code == 0 and "credentials accepted" in checked.output, checked.output
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    (tmp_path / "remote.yaml").write_text(PROTOCOL)
    result = CliRunner().invoke(
        ablate,
        [
            "--protocol",
            str(tmp_path / "remote.yaml"),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(folder),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "cells: 2 run, 0 already finished (skipped), 0 failed" in result.output
    assert not isolated_tracking.exists(), "nothing should have gone to the fallback store"

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("remote")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        assert run.data.tags["mlflow.user"] == WORKER[0], (
            "the account that logged in, not the OS user (parent too)"
        )
        if run.data.tags.get("cell") == "true":
            assert [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [
                1,
                2,
            ]
            assert {a.path for a in client.list_artifacts(run.info.run_id, "predictions")} == {
                "predictions/val.csv",
                "predictions/test.csv",
            }
            models = client.search_logged_models(
                [exp.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'"
            )
            assert [m.status for m in models] == ["READY"]
        for value in [*run.data.params.values(), *run.data.tags.values()]:
            for secret in (WORKER[1], f"{WORKER[0]}:{WORKER[1]}", ADMIN[1]):
                assert secret not in value, f"a credential was logged in run {run.info.run_id}"
    out, err = capfd.readouterr()
    for text in (result.output, out, err):
        assert WORKER[1] not in text and ADMIN[1] not in text, "a credential was printed"
    # The server knows who logged: the creator of an experiment manages it.
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    from mlflow.server import get_app_client

    permission = get_app_client("basic-auth", tracking_uri=url).get_user_permission(
        WORKER[0], "experiment", exp.experiment_id
    )
    assert permission.permission == "MANAGE"


@pytest.mark.integration
def test_wrong_credentials_are_refused_with_a_clear_error(
    auth_server, isolated_tracking, tmp_path, monkeypatch
):
    wrong = "not-the-password-42"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", auth_server.url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", wrong)
    (tmp_path / "remote.yaml").write_text(PROTOCOL)
    # through `workbench`, as a user runs them: tracking/ raises a plain error, the CLI says it in one line
    for args in (
        ["ablate", "--protocol", str(tmp_path / "remote.yaml"), "--allow-dirty"],
        ["sync"],
        ["server", "check"],
    ):
        offline_store.forget_health()
        (isolated_tracking / "mlflow.db").parent.mkdir(exist_ok=True)
        (isolated_tracking / "mlflow.db").touch()  # so that sync gets as far as the server
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, result.output
        for needed in (
            auth_server.url,
            "refused the credentials",
            "HTTP 401",
            "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD",
        ):
            assert needed in result.output, (args[0], result.output)
        assert wrong not in result.output
    assert os.path.getsize(isolated_tracking / "mlflow.db") == 0, (
        "refused credentials must not send runs offline"
    )


@pytest.fixture(scope="module")
def carol_and_dave(auth_server):
    """Two more users of the module's server (created once, as the admin)."""
    for user in (CAROL, DAVE):
        server_users.add_user(auth_server.url, *user, *ADMIN)
    return auth_server.url


def admin_says(monkeypatch, *args: str) -> tuple[int, str]:
    """``workbench server ARGS`` as the admin: (exit code, output)."""
    monkeypatch.setenv(server_config.ADMIN_USER_ENV, ADMIN[0])
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    result = CliRunner().invoke(server_command, list(args))
    return result.exit_code, result.output


@pytest.mark.integration
def test_a_grant_is_changed_and_revoked_over_http(carol_and_dave, isolated_tracking, monkeypatch):
    url = carol_and_dave
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    client = MlflowClient(url)
    as_user(monkeypatch, CAROL)
    exp = client.create_experiment("carol-grants")
    run = client.create_run(exp).info.run_id
    where = f"on experiment 'carol-grants' (id {exp}) on {url}"
    assert admin_says(monkeypatch, "grant", "dave", "carol-grants")[1].startswith(
        f"dave: EDIT {where}\n"
    )
    assert admin_says(monkeypatch, "grant", "dave", "carol-grants")[1].startswith(
        f"dave: EDIT {where} (unchanged)"
    )
    assert admin_says(monkeypatch, "grant", "dave", "carol-grants", "--permission", "manage") == (
        0,
        f"dave: MANAGE {where} (was EDIT)\n",
    )
    as_user(monkeypatch, DAVE)
    assert http_status(lambda: client.delete_run(run)) is None  # MANAGE deletes
    client.restore_run(run)
    assert admin_says(monkeypatch, "revoke", "dave", "carol-grants") == (
        0,
        f"dave: MANAGE on experiment 'carol-grants' (id {exp}) revoked on {url}; dave now has READ there\n",
    )
    as_user(monkeypatch, DAVE)
    assert http_status(lambda: client.log_metric(run, "loss", 1.0)) == 403
    assert client.get_run(run).info.run_id == run  # the default, READ, again
    assert admin_says(monkeypatch, "revoke", "dave", "carol-grants") == (
        1,
        f"Error: 'dave' holds no grant on experiment 'carol-grants' (id {exp}) on {url}; nothing changed\n",
    )
    assert admin_says(monkeypatch, "grant", "dave", "carol-grants", "--permission", "DENY")[0] == 0
    as_user(monkeypatch, DAVE)
    assert http_status(lambda: client.get_run(run)) == 403
    # dave (no admin, holding DENY) tries a grant as if he were the admin: the real reason, not "no experiment"
    monkeypatch.setenv(server_config.ADMIN_USER_ENV, DAVE[0])
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, DAVE[1])
    for experiment in (exp, "carol-grants"):
        result = CliRunner().invoke(server_command, ["grant", "dave", experiment])
        assert (
            result.exit_code == 1
            and f"experiment {experiment!r} on {url}: the server refused to show it "
            "(HTTP 403): 'dave' (WORKBENCH_SERVER_ADMIN_USER) is not an admin of this server"
            in result.output
        ), result.output
        assert "no experiment" not in result.output and DAVE[1] not in result.output
    assert "holds DENY there" in CliRunner().invoke(server_command, ["grant", "dave", exp]).output


@pytest.mark.integration
def test_edit_lets_a_collaborator_rename_and_fail_finished_runs_but_not_delete(
    carol_and_dave, isolated_tracking, monkeypatch, tmp_path
):
    """What docs/server.md says READ, USE, EDIT and MANAGE allow, as MLflow 3.17 enforces it."""
    url = carol_and_dave
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    client = MlflowClient(url)
    as_user(monkeypatch, CAROL)
    exp = client.create_experiment("carol-edit")
    run = client.create_run(exp).info.run_id
    client.set_terminated(run, "FINISHED")
    (tmp_path / "f.txt").write_text("dave's")
    attempts = {
        "log a metric": lambda: client.log_metric(run, "loss", 1.0),
        "upload an artifact": lambda: client.log_artifact(run, str(tmp_path / "f.txt")),
        "set a finished run of carol to FAILED": lambda: client.set_terminated(run, "FAILED"),
        "tag the experiment": lambda: client.set_experiment_tag(exp, "by", "dave"),
        "rename the experiment": lambda: client.rename_experiment(exp, "dave-renamed"),
        "delete the run": lambda: client.delete_run(run),
        "delete the experiment": lambda: client.delete_experiment(exp),
    }
    allowed = {}
    for permission in ("USE", "EDIT"):
        code, out = admin_says(monkeypatch, "grant", "dave", exp, "--permission", permission)
        assert code == 0, out
        as_user(monkeypatch, DAVE)
        allowed[permission] = [
            what for what, action in attempts.items() if http_status(action) is None
        ]
    assert allowed == {"USE": [], "EDIT": list(attempts)[:5]}, allowed
    assert "note: EDIT lets dave rename experiment" in out, out  # said when EDIT is granted
    assert (
        client.get_run(run).info.status == "FAILED"
        and client.get_experiment(exp).name == "dave-renamed"
    )


@pytest.mark.integration
def test_runs_record_the_account_that_logged_in(carol_and_dave, isolated_tracking, monkeypatch):
    from tracking.store.session import start_run
    from tracking.record.cell_runs import open_keyed_run

    host = carol_and_dave.removeprefix("http://")
    # the user in the URL
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{DAVE[0]}:{DAVE[1]}@{host}")
    with start_run("dave-runs") as run:
        fluent = run.info.run_id
    # as a cell of `ablate` or `train`
    opened = open_keyed_run("dave-runs", "key-1", {"mlflow.user": "root"})
    opened.sink.end("FINISHED")
    client = MlflowClient(carol_and_dave)
    as_user(monkeypatch, DAVE)
    for run_id in (fluent, opened.run_id):
        seen = client.get_run(run_id)
        assert (seen.data.tags["mlflow.user"], seen.info.user_id) == ("dave", "dave"), run_id


@pytest.mark.integration
def test_sync_prints_no_credentialed_url(
    carol_and_dave, isolated_tracking, tmp_path, monkeypatch, capfd
):
    import importlib

    import tracking

    local = MlflowClient(f"sqlite:///{tmp_path / 'offline.db'}")
    exp = local.create_experiment("dave-offline", artifact_location=(tmp_path / "art").as_uri())
    run = local.create_run(exp, tags={"mlflow.runName": "offline-run"}).info.run_id
    local.log_metric(run, "loss", 0.5)
    local.set_terminated(run, "FINISHED")
    # as in a new process:
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    importlib.reload(tracking)  # what importing the workbench's tracking package sets
    target = carol_and_dave.replace("http://", f"http://{DAVE[0]}:{DAVE[1]}@")
    result = CliRunner().invoke(
        sync_command, ["--from", f"sqlite:///{tmp_path / 'offline.db'}", "--to", target]
    )
    assert result.exit_code == 0 and "runs: 1 created" in result.output, result.output
    out, err = capfd.readouterr()
    for text in (result.output, out, err):
        assert DAVE[1] not in text and "View run" not in text, text


@pytest.mark.integration
@pytest.mark.slow  # 6 s of server start: the default tier neared its 5 minutes (docs/testing.md)
def test_a_server_that_dies_at_start_exits_non_zero(tmp_path):
    # the server process refuses it after the launcher started it
    nothing = "nosuchdb://127.0.0.1/runs"
    launcher = Launcher(
        [
            "--backend-store-uri",
            nothing,
            "--auth-db-uri",
            f"sqlite:///{tmp_path / 'auth.db'}",
            "--artifacts-destination",
            str(tmp_path / "a"),
            "--port",
            str(free_port()),
            "--workers",
            "1",
        ],
        server_env(tmp_path),
        tmp_path / "launcher.log",
    )
    result = subprocess.run(
        launcher.cmd,
        env=launcher.env,
        cwd=launcher.cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        result.stderr.strip().splitlines()[-1].startswith("Error: mlflow server exited with code")
    ), result.stderr[-2000:]
    assert not list((tmp_path / "run").glob("launch-*")), "a runtime folder was left"


@pytest.mark.integration
@pytest.mark.slow  # 13 s with its teardown: the default tier neared its 5 minutes (docs/testing.md)
def test_sigkill_of_the_launcher_leaves_no_server_and_no_secret_file(tmp_path):
    port = free_port()
    launcher = Launcher(
        [
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'runs.db'}",
            "--auth-db-uri",
            f"sqlite:///{tmp_path / 'auth.db'}",
            "--artifacts-destination",
            str(tmp_path / "a"),
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        server_env(tmp_path),
        tmp_path / "launcher.log",
    )
    launcher.start()
    try:
        below = descendants(launcher.proc.pid)
        secrets_dir = list((tmp_path / "run").glob("launch-*"))
        assert len(below) >= 3 and [p.name for p in secrets_dir[0].iterdir()] == [
            "basic_auth.ini"
        ], below
        os.kill(launcher.proc.pid, signal.SIGKILL)
        launcher.proc.wait(timeout=10)
        killed = time.monotonic()
        while time.monotonic() - killed < 10:
            left = {pid for pid in below if running(pid)}
            with socket.socket() as s:
                listening = s.connect_ex(("127.0.0.1", port)) == 0
            if not left and not listening and not secrets_dir[0].exists():
                break
            time.sleep(0.2)
        assert not left and not listening, (
            f"after 10 s: processes {sorted(left)} alive, port listening: {listening}"
        )
        assert not secrets_dir[0].exists(), "the secret files outlived the launcher"
        print(f"server gone {time.monotonic() - killed:.1f} s after SIGKILL of its launcher")
    finally:
        launcher.stop()


@pytest.mark.integration
def test_a_strangers_experiment_holding_a_forged_parent_is_not_the_study(
    carol_and_dave, isolated_tracking, monkeypatch
):
    """carol (READ on others' experiments, like every account) plants a run tagged as a parent of
    dave's protocol in an experiment of her own: dave's study does not go there, and the error for
    an experiment another account holds advises dave no grant of his own."""
    from tracking.record.protocol_runs import experiment_id_for, frozen_hashes, no_edit_grant

    url = carol_and_dave
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    client = MlflowClient(url)
    as_user(monkeypatch, CAROL)
    trap = client.create_experiment("carols-trap")
    client.create_run(
        trap,
        tags={"protocol_name": "daves_study", "protocol_hash": "f00d", "parent": "true"},
    )
    as_user(monkeypatch, DAVE)
    assert frozen_hashes("daves_study") == set(), "a stranger's forged parent froze dave's protocol"
    mine = experiment_id_for("daves_study")
    assert mine != trap and client.get_experiment(mine).name == "daves_study", mine
    # An experiment of the protocol's name that another account made first (squatted):
    as_user(monkeypatch, CAROL)
    squat = client.create_experiment("daves_other_study")
    as_user(monkeypatch, DAVE)
    message = str(no_edit_grant(client, squat))
    assert "workbench server grant dave" not in message and "another name" in message, message
