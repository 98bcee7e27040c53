"""Remote tracking: the server launcher, users, a protocol run over HTTP with basic-auth, refused credentials.

The integration tests start PostgreSQL (runs and users each in a database of their own)
and the server exactly as ``workbench server start`` runs it, on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from servers import isolated_tracking, postgres_server, workbench_server  # noqa: F401  (fixture)
from studies.ablate import ablate
from studies.server import server as server_command
from studies.sync import sync as sync_command
from tracking import offline_fallback as resilient
from tracking import server as ts

ROOT = Path(__file__).resolve().parent.parent
ADMIN = ("admin", "remote-admin-Passw0rd")
WORKER = ("worker", "colab-worker-Passw0rd")
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


@pytest.mark.parametrize("user, password, error", [
    ("admin", None, "set WORKBENCH_SERVER_ADMIN_PASSWORD"),
    ("admin", "password1234", "published default"),
    ("admin", "short-pw", "shorter than 12"),
    ("adminadmin12", "adminadmin12", "derived from the user name"),
    (None, "a-fine-password-1", "set WORKBENCH_SERVER_ADMIN_USER"),
])
def test_the_launcher_refuses_missing_default_or_weak_admin_passwords(user, password, error, tmp_path):
    cfg = ts.ServerConfig("sqlite:///x.db", str(tmp_path))
    with pytest.raises(ts.ServerConfigError, match=error):
        with ts.prepared_server(cfg, user, password):
            pass


def test_server_start_refuses_the_default_password_before_starting_anything(monkeypatch, tmp_path):
    monkeypatch.setenv(ts.ADMIN_PASSWORD_ENV, "password1234")
    result = CliRunner().invoke(server_command, ["start", "--backend-store-uri", f"sqlite:///{tmp_path}/m.db",
                                                 "--artifacts-destination", str(tmp_path / "a")])
    assert result.exit_code == 1 and "published default" in result.output, result.output
    assert "password1234" not in result.output
    assert not (tmp_path / "m.db").exists()


def test_server_environment_keeps_secrets_off_the_command_line_and_the_ini_private(tmp_path):
    cfg = ts.ServerConfig("postgresql://mlflow:db-secret-99@127.0.0.1/mlflow", str(tmp_path / "art"), port=5099,
                          allowed_hosts="mlflow.example.org", cors_allowed_origins="https://mlflow.example.org",
                          auth_database_uri="postgresql://mlflow:db-secret-99@127.0.0.1/mlflow_auth")
    with ts.prepared_server(cfg, *ADMIN) as (cmd, env):
        ini = Path(env["MLFLOW_AUTH_CONFIG_PATH"])
        assert stat.S_IMODE(ini.stat().st_mode) == 0o600
        text = ini.read_text()
        assert ADMIN[1] not in text and "admin_username = admin" in text and "default_permission = EDIT" in text
        assert not any("db-secret-99" in a or ADMIN[1] in a for a in cmd), cmd
        assert env["MLFLOW_BACKEND_STORE_URI"] == cfg.backend_store_uri and env["MLFLOW_AUTH_ADMIN_PASSWORD"] == ADMIN[1]
        for flag, value in (("--app-name", "basic-auth"), ("--allowed-hosts", "mlflow.example.org"),
                            ("--cors-allowed-origins", "https://mlflow.example.org"), ("--port", "5099")):
            assert cmd[cmd.index(flag) + 1] == value
        assert "--serve-artifacts" in cmd and cmd[cmd.index("--artifacts-destination") + 1] == str(tmp_path / "art")
    assert not ini.exists(), "the auth ini outlives the server"
    assert "db-secret-99" not in ts.describe(cfg)


def test_uris_and_values_are_redacted(monkeypatch):
    assert resilient.redact_uri("https://bob:s3cret@mlflow.example.org/x") == "https://***@mlflow.example.org/x"
    assert resilient.redact_uri("postgresql://u:p@h:5432/db and http://h/p?a=b@c") == \
        "postgresql://***@h:5432/db and http://h/p?a=b@c"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-value")
    assert resilient.scrub("token s3cret-value and bob:s3cret-value") == "token *** and ***"


def test_unreachable_and_refused_are_told_apart():
    import requests
    from mlflow.utils.rest_utils import verify_rest_response

    def wrapped(inner):  # how MLflow reports a failed request: a new exception, the original as context
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

    assert resilient.is_unreachable(wrapped(requests.exceptions.ConnectionError("refused")))
    assert resilient.is_unreachable(answered(502, b"Bad Gateway"))  # a tunnel whose server is down
    refused = answered(401, b"You are not authenticated.")
    assert resilient.is_auth_failure(refused) and not resilient.is_unreachable(refused)
    mlflow_said_no = answered(400, b'{"error_code": "INVALID_PARAMETER_VALUE", "message": "Changing param values"}')
    assert not resilient.is_unreachable(mlflow_said_no) and not resilient.is_auth_failure(mlflow_said_no)


def test_the_colab_notebook_is_valid_nbformat_4():
    nb = json.loads((ROOT / "notebooks" / "colab_t4.ipynb").read_text())
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int) and "metadata" in nb
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("markdown", "code") and isinstance(cell["source"], (list, str))
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and "execution_count" in cell
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for needed in ("userdata.get", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                   "torch.cuda", "workbench worker", "--device cuda", "workbench ablate", "workbench sync"):
        assert needed in code, needed
    script = (ROOT / "scripts" / "remote_gpu.sh").read_text()
    for needed in ("MLFLOW_TRACKING_URI", "remote_gpu.sh worker --storage", "workbench sync", "set -euo pipefail"):
        assert needed in script, needed


# ---------------------------------------------------------------- a real server on PostgreSQL


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    with postgres_server(("mlflow", "mlflow_auth")) as pg:
        with workbench_server(f"{pg}/mlflow", root / "artifacts", ADMIN, auth_db=f"{pg}/mlflow_auth") as server:
            yield server


@pytest.mark.integration
def test_a_protocol_runs_over_http_with_auth_and_no_credential_is_logged(auth_server, isolated_tracking, tmp_path,
                                                                          monkeypatch, capfd):
    url = auth_server.url
    monkeypatch.setenv(ts.ADMIN_USER_ENV, ADMIN[0])
    monkeypatch.setenv(ts.ADMIN_PASSWORD_ENV, ADMIN[1])
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
    result = CliRunner().invoke(ablate, ["--protocol", str(tmp_path / "remote.yaml"), "--allow-dirty", "--device", "cpu",
                                         "--data-path", str(folder), "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "cells: 2 run, 0 already finished (skipped), 0 failed" in result.output
    assert not isolated_tracking.exists(), "nothing should have gone to the fallback store"

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("remote")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        if run.data.tags.get("cell") == "true":
            assert [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [1, 2]
            assert {a.path for a in client.list_artifacts(run.info.run_id, "predictions")} == \
                {"predictions/val.csv", "predictions/test.csv"}
            models = client.search_logged_models([exp.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")
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

    permission = get_app_client("basic-auth", tracking_uri=url).get_user_permission(WORKER[0], "experiment",
                                                                                   exp.experiment_id)
    assert permission.permission == "MANAGE"


@pytest.mark.integration
def test_wrong_credentials_are_refused_with_a_clear_error(auth_server, isolated_tracking, tmp_path, monkeypatch):
    wrong = "not-the-password-42"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", auth_server.url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", wrong)
    (tmp_path / "remote.yaml").write_text(PROTOCOL)
    for command, args in ((ablate, ["--protocol", str(tmp_path / "remote.yaml"), "--allow-dirty"]), (sync_command, []),
                          (server_command, ["check"])):
        resilient.forget_health()
        (isolated_tracking / "mlflow.db").parent.mkdir(exist_ok=True)
        (isolated_tracking / "mlflow.db").touch()  # so that sync gets as far as the server
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 1, result.output
        for needed in (auth_server.url, "refused the credentials", "HTTP 401", "MLFLOW_TRACKING_USERNAME",
                       "MLFLOW_TRACKING_PASSWORD"):
            assert needed in result.output, (command.name, result.output)
        assert wrong not in result.output
    assert os.path.getsize(isolated_tracking / "mlflow.db") == 0, "refused credentials must not send runs offline"
