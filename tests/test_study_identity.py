"""A study's record is found by what it is (the protocol's runs, in this account's experiments), not by
its experiment's name: after a rename, status, report, figures and the acting kinds' lookup find it.

The runs are hand-made as ``ablate`` makes them (tests/test_report.py ``make_store``): no training.
The same on a server with accounts, where another account holds the protocol's name, is in
tests/test_study_identity_server.py.
"""

from __future__ import annotations

from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.cli import main
from test_report import make_store
from tracking.kinds.figure_runs import find_protocol_runs
from tracking.kinds.transfer_runs import find_finished_cell
from tracking.record import queries
from tracking.record.protocol_runs import experiment_id_for

RENAMED = "study (renamed in the UI)"


def renamed_study(tmp_path):
    """The hand-made study, its experiment renamed after it ran."""
    store = make_store(tmp_path)
    client = MlflowClient()
    exp_id = client.get_experiment_by_name("study").experiment_id
    client.rename_experiment(exp_id, RENAMED)
    return store, exp_id


def test_a_renamed_study_is_found_by_status_report_figures_and_the_acting_kinds(
    tmp_path, mlflow_store
):
    store, exp_id = renamed_study(tmp_path)
    client, runner = MlflowClient(), CliRunner()
    status = runner.invoke(main, ["status", "--protocol", str(store.protocol_path)])
    assert status.exit_code == 0, status.output
    assert f"parent run {store.parents[0]}: FINISHED" in status.output, status.output
    assert "never run here" not in status.output, status.output

    out = tmp_path / "report"
    report = runner.invoke(
        main,
        ["report", "--protocol", str(store.protocol_path), "--out-dir", str(out), "--no-log"],
    )
    assert report.exit_code == 0, report.output
    assert "9 of 9 cells have a finished run" in report.output, report.output
    md = (out / "study" / "report.md").read_text()
    missing = [run for run in store.cells.values() if run not in md]
    assert not missing, f"{len(missing)} of the renamed study's cells not in its report: {missing}"

    # The acting kinds (intervene, attribute, transfer) find the trained cell they act on ...
    digest = store.protocol.hash
    for (arm, seed), run_id in store.cells.items():
        assert find_finished_cell("study", digest, arm, seed) == run_id, (arm, seed)
    # ... figures its finished cells, and a new execution continues the record in place.
    found = find_protocol_runs("study", digest)
    assert sorted(r.info.run_id for r in found.cells) == sorted(store.cells.values())
    assert experiment_id_for("study") == exp_id
    assert [p.run_id for p in queries.parent_runs("study", digest)] == store.parents
    assert queries.hash_counts("study") == {digest: 9}
    assert [e.name for e in queries.protocol_entries()] == ["study"]
    assert client.get_experiment_by_name("study") is None, "a lookup created an experiment"


def test_http_403_is_not_answered_with_advice_to_set_other_credentials():
    """403: the server accepted the credentials and refused the account this; 401: they are wrong."""
    from tracking.store.health import auth_error

    url = "http://127.0.0.1:5000"
    refused, denied = str(auth_error(url, 401)), str(auth_error(url, 403))
    assert "Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in refused, refused
    assert "MLFLOW_TRACKING_USERNAME" not in denied, denied
    assert "accepted the credentials" in denied and "HTTP 403" in denied, denied
