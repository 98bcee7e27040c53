"""The planted-record attack, against the real server with basic-auth (as ``workbench server start``
runs it, on SQLite): alice runs a study and renames its experiment; bob, who may
only read hers, creates an experiment of the protocol's name holding copies of her parent and
cells (FINISHED, accuracy 0.999, tagged ``mlflow.user=alice``). alice's ``status``, ``report`` and
``ablate`` stay on her own record and say in one line that the name is another account's.
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient

import test_report
from data_fixtures import make_image_folder
from servers import ServerProcess, free_port, isolated_tracking  # noqa: F401  (a fixture)
from studies.cli import main
from test_remote import ADMIN, ALICE, BOB, as_user
from tracking.record import study_record
from tracking.record.protocol_runs import experiment_id_for
from tracking.server import server_users
from tracking.server.server_config import ServerConfig, prepared_server
from tracking.store import health
from workbench.train.fingerprint import current_code_fingerprint

SQUAT = re.compile(
    r"experiment 'study' \(id (\d+)\) on \S+ belongs to another account and is not read: "
    r"this study's record is experiment 'study \(alice\)' \(id (\d+)\)"
)


@pytest.fixture(scope="module")
def alice_and_bob(tmp_path_factory):
    """A basic-auth server with the accounts alice and bob (READ on each other's experiments, the
    server's default); one per module. Its start may take minutes on a busy machine."""
    root = tmp_path_factory.mktemp("identity")
    cfg = ServerConfig(
        f"sqlite:///{root / 'server.db'}",
        str(root / "artifacts"),
        port=free_port(),
        workers=1,
        auth=True,
        auth_database_uri=f"sqlite:///{root / 'auth.db'}",
    )
    with prepared_server(cfg, *ADMIN) as (cmd, env):
        server = ServerProcess(cmd, env, cfg.port, root / "server.log")
        server.start(timeout=600)
        try:
            for user in (ALICE, BOB):
                server_users.add_user(server.url, *user, *ADMIN)
            yield server.url
        finally:
            server.stop()


def plant(client: MlflowClient, alice_parent: str, alice_cells: dict) -> tuple[str, str, list[str]]:
    """bob's experiment of the protocol's name, with copies of alice's parent and cells, better ones."""
    trap = client.create_experiment("study")
    parent = client.get_run(alice_parent)
    copy = client.create_run(trap, tags=dict(parent.data.tags)).info.run_id
    client.set_terminated(copy, RunStatus.to_string(RunStatus.FINISHED))
    cells = []
    for run_id in alice_cells.values():
        tags = {**client.get_run(run_id).data.tags, "mlflow.parentRunId": copy}
        cell = client.create_run(trap, tags=tags).info.run_id
        client.log_batch(
            cell,
            metrics=[Metric(k, 0.999, 1, 0) for k in ("best_val_accuracy", "test_accuracy")],
        )
        client.set_terminated(cell, RunStatus.to_string(RunStatus.FINISHED))
        cells.append(cell)
    return trap, copy, cells


@pytest.mark.integration
@pytest.mark.slow  # three accounts' studies against one server: 45 to 50 s, the slow tier's
def test_a_planted_record_under_the_protocols_name_is_never_alices(
    alice_and_bob, isolated_tracking, tmp_path, monkeypatch
):
    url = alice_and_bob
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    # Her cells carry this code's fingerprint, so `ablate` finds them finished and trains none.
    monkeypatch.setattr(test_report, "CODE_FINGERPRINT", current_code_fingerprint())
    client, runner = MlflowClient(url), CliRunner()
    as_user(monkeypatch, ALICE)
    assert health.server_account(url) == "alice"
    store = test_report.make_store(tmp_path / "alice")
    mine = client.get_experiment_by_name("study").experiment_id
    client.rename_experiment(mine, "study (alice)")

    as_user(monkeypatch, BOB)
    assert health.server_account(url) == "bob"
    trap, planted, planted_cells = plant(client, store.parents[0], store.cells)
    assert client.get_run(planted).data.tags["mlflow.user"] == "alice", "MLflow keeps a forged user"

    as_user(monkeypatch, ALICE)
    status = runner.invoke(main, ["status", "--protocol", str(store.protocol_path)])
    assert status.exit_code == 0, status.output
    assert f"parent run {store.parents[0]}: FINISHED" in status.output, status.output
    assert planted not in status.output, status.output
    assert SQUAT.search(status.output).groups() == (trap, mine), status.output

    out = tmp_path / "report"
    args = ["--protocol", str(store.protocol_path), "--out-dir", str(out), "--no-log"]
    monkeypatch.setattr(study_record, "_told", set())  # each command is a process of its own
    report = runner.invoke(main, ["report", *args])
    assert report.exit_code == 0, report.output
    assert SQUAT.search(report.output), report.output
    md = (out / "study" / "report.md").read_text()
    assert all(run in md for run in store.cells.values()), "her cells are not all in her report"
    linked = [run for run in (planted, *planted_cells) if run in md]
    assert not linked, f"bob's runs in alice's report: {linked}"

    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    monkeypatch.setattr(study_record, "_told", set())
    ablate = runner.invoke(
        main,
        [
            "ablate",
            "--protocol",
            str(store.protocol_path),
            "--data-path",
            str(folder),
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "out"),
            "--allow-dirty",
        ],
    )
    assert ablate.exit_code == 0, ablate.output
    assert f"parent run {store.parents[0]} reattached" in ablate.output, ablate.output
    assert "MLFLOW_TRACKING_USERNAME" not in ablate.output and planted not in ablate.output
    assert len(SQUAT.findall(ablate.output)) == 1, ablate.output
    record = client.get_run(store.parents[0]).data.tags
    assert record["mlflow.user"] == "alice", record
    assert client.get_run(planted).info.status == "FINISHED", "bob's runs were touched"


@pytest.mark.integration
def test_a_new_study_whose_name_another_account_holds_goes_under_its_own_name(
    alice_and_bob, isolated_tracking, monkeypatch, capsys
):
    url = alice_and_bob
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    client = MlflowClient(url)
    as_user(monkeypatch, BOB)
    squat = client.create_experiment("fresh")
    as_user(monkeypatch, ALICE)
    mine = experiment_id_for("fresh")
    assert mine != squat and client.get_experiment(mine).name == "fresh@alice", mine
    said = capsys.readouterr().err
    assert (
        f"experiment 'fresh' (id {squat}) on {url} belongs to another account and is not read: "
        "this study's record is experiment 'fresh@alice'" in said
    ), said
    assert experiment_id_for("fresh") == mine, "the next execution finds it by its runs or name"


@pytest.mark.integration
def test_a_worker_with_an_edit_grant_works_in_the_study_its_queue_names(
    alice_and_bob, isolated_tracking, monkeypatch
):
    """bob, granted EDIT on alice's study, works in her experiment: his worker through the parent run
    its queue names, his own lookup of the name through the grant (the default READ is none)."""
    url = alice_and_bob
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    client = MlflowClient(url)
    as_user(monkeypatch, ALICE)
    hers = experiment_id_for("queued")
    parent = client.create_run(
        hers, tags={"protocol_name": "queued", "protocol_hash": "f00d", "parent": "true"}
    ).info.run_id
    as_user(monkeypatch, BOB)
    assert experiment_id_for("queued", record_run=parent) == hers
    before = experiment_id_for("queued")  # READ, the server's default, is no grant
    assert client.get_experiment(before).name == "queued@bob", before
    server_users.grant(url, BOB[0], "queued", "EDIT", *ADMIN)
    assert experiment_id_for("queued") == hers, "a collaborator with EDIT continues her study"
