"""Find-or-create-once (tracking/record/create_once.py), two executions interleaved step by step on a real store.

On a tracking server nothing serialises two executions: each creates its own candidate and
the first by (start time, run id) is the run. Here the other execution's create is placed
exactly where it hurts: while this one waits before listing, and after that wait, with a
start time read earlier (a create slower than the wait). Each test takes well under 2 s.
"""

from __future__ import annotations

import os

import pytest
from mlflow.entities import RunTag, ViewType
from mlflow.tracking import MlflowClient

from tracking.record.cell_runs import open_keyed_run, withdraw_candidate
from tracking.record import create_once
from tracking.record.create_once import ClaimLost
from tracking.record.lease import HOST, SUPERSEDED_TAG, lease_tags, new_token

KEY = "cellkey0123456789abcdef0"


def other_execution_lease() -> dict[str, str]:
    """The lease of a live process on this host that is not this one (the other execution)."""
    return {**lease_tags(new_token()), "lease.pid": str(os.getppid())}


def everything(client: MlflowClient, exp_id: str, where: str) -> list:
    return client.search_runs([exp_id], where, ViewType.ALL)


@pytest.fixture
def parent(mlflow_store):
    client = MlflowClient()
    exp_id = client.create_experiment("rec")
    return client, exp_id, client.create_run(exp_id, tags={"parent": "true"}).info.run_id


def their_candidate(client: MlflowClient, exp_id: str, parent_id: str, start_time: int) -> str:
    tags = {
        "run_key": KEY,
        "cell": "true",
        "mlflow.parentRunId": parent_id,
        **other_execution_lease(),
    }
    return client.create_run(exp_id, start_time=start_time, tags=tags).info.run_id


def open_cell(parent_id: str):
    return open_keyed_run(
        "rec",
        KEY,
        {"mlflow.runName": "vit-seed0", "cell": "true", **lease_tags(new_token())},
        parent_id,
    )


def assert_withdrawn(client: MlflowClient, run_id: str, winner: str) -> None:
    run = client.get_run(run_id)
    assert (run.info.status, run.info.lifecycle_stage) == ("KILLED", "deleted"), (
        run.info.status,
        run.info.lifecycle_stage,
    )
    assert run.data.tags.get(SUPERSEDED_TAG) == winner, run.data.tags
    assert not [k for k in run.data.tags if k.startswith("lease.")], run.data.tags


def test_a_candidate_created_while_this_one_waits_and_sorting_first_is_the_cells_run(
    parent, monkeypatch
):
    client, exp_id, parent_id = parent
    real, theirs = create_once.settle, []

    def other_creates_meanwhile(c):  # the other execution's create lands during this one's wait
        if not theirs:
            ours = everything(client, exp_id, f"tags.run_key = '{KEY}'")
            theirs.append(their_candidate(client, exp_id, parent_id, ours[0].info.start_time - 50))
        real(c)

    monkeypatch.setattr(create_once, "settle", other_creates_meanwhile)
    opened = open_cell(parent_id)
    assert (opened.status, opened.run_id, opened.sink) == ("BUSY", theirs[0], None), opened
    assert "another execution created its run at the same moment" in opened.why, opened.why
    (ours,) = [
        r.info.run_id
        for r in everything(client, exp_id, f"tags.run_key = '{KEY}'")
        if r.info.run_id != theirs[0]
    ]
    assert_withdrawn(client, ours, theirs[0])
    # The other execution, resolving after its own wait, finds itself first: one run, both agree.
    found = lambda: [r for r in client.search_runs([exp_id], f"tags.run_key = '{KEY}'")]  # noqa: E731
    assert create_once.resolve_new(client, theirs[0], found).info.run_id == theirs[0]
    assert [r.info.run_id for r in found()] == theirs, "exactly one active run for the cell"


def test_a_candidate_sorting_first_that_appears_after_the_wait_stops_this_one_before_its_first_step(
    parent,
):
    client, exp_id, parent_id = parent
    opened = open_cell(parent_id)
    # alone after its wait: it is the run
    assert opened.status is None and opened.confirm is not None, opened
    # a slow create
    theirs = their_candidate(client, exp_id, parent_id, opened.sink.journal.start_time - 50)
    found = lambda: client.search_runs([exp_id], f"tags.run_key = '{KEY}'")  # noqa: E731
    assert create_once.resolve_new(client, theirs, found).info.run_id == theirs  # they go on
    with pytest.raises(ClaimLost) as lost:  # the look before the first training step
        opened.confirm()
    assert lost.value.winner == theirs and theirs in str(lost.value)
    withdraw_candidate(opened.sink, lost.value)
    assert_withdrawn(client, opened.run_id, theirs)
    assert [r.info.run_id for r in found()] == [theirs]


def test_of_two_executions_resuming_one_killed_cell_at_once_the_token_left_on_it_decides(
    parent, monkeypatch
):
    import subprocess
    import sys

    client, exp_id, parent_id = parent
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its holder's process is gone: the run may be resumed in place
    killed = client.create_run(
        exp_id,
        tags={
            "run_key": KEY,
            "cell": "true",
            "mlflow.parentRunId": parent_id,
            **lease_tags(new_token()),
            "lease.pid": str(gone.pid),
        },
    ).info.run_id
    client.set_terminated(killed, "KILLED")
    real, theirs = create_once.settle, other_execution_lease()

    def other_writes_its_token_meanwhile(c):  # the other execution's token lands after ours
        client.log_batch(killed, tags=[RunTag(k, v) for k, v in theirs.items()])
        real(c)

    monkeypatch.setattr(create_once, "settle", other_writes_its_token_meanwhile)
    opened = open_cell(parent_id)
    assert (opened.status, opened.run_id, opened.sink) == ("BUSY", killed, None), opened
    assert "took run" in opened.why and "at the same moment" in opened.why, opened.why
    run = client.get_run(killed)
    assert run.info.status == "KILLED" and run.data.tags["lease.token"] == theirs["lease.token"], (
        "left to them"
    )
    monkeypatch.setattr(create_once, "settle", real)
    # they hold it
    assert create_once.holder_after_wait(client, killed, theirs["lease.token"]) is None


def test_two_candidates_with_one_start_time_are_ordered_by_run_id(parent):
    client, exp_id, parent_id = parent
    a, b = (their_candidate(client, exp_id, parent_id, 1_700_000_000_000) for _ in range(2))
    found = lambda: client.search_runs([exp_id], f"tags.run_key = '{KEY}'")  # noqa: E731
    assert {
        create_once.resolve_new(client, a, found).info.run_id,
        create_once.resolve_new(client, b, found).info.run_id,
    } == {min(a, b)}


def test_a_duplicate_parent_is_withdrawn_without_a_lease_tag_and_the_first_is_shared(
    tmp_path, mlflow_store, monkeypatch
):
    from studies.ablation.ablate import open_protocol
    from tracking.record import protocol_runs
    from tracking.record.protocol_runs import close_study_parent, open_study_parent, study_key

    # Not under test, and its first call imports timm (seconds): the study key needs a fingerprint only.
    monkeypatch.setattr(protocol_runs, "current_code_fingerprint", lambda: "0123456789abcdef")
    path = tmp_path / "rec.yaml"
    path.write_text(
        "name: rec\ndescription: d\ndataset: {name: image_folder, val_size: 6, split_seed: 3}\n"
        "model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, "
        "depth: 1, heads: 2, mlp_hidden: 32}\noptim: {lr: 0.003}\nrun: {epochs: 1, batch_size: 8}\n"
        "arms:\n  - {name: vit, reference: true}\nseeds: [0]\n"
    )
    protocol = open_protocol(str(path), allow_dirty=True)
    client, real, theirs = MlflowClient(), create_once.settle, []

    def other_creates_meanwhile(c):
        if not theirs:
            (ours,) = client.search_runs(
                [client.get_experiment_by_name("rec").experiment_id], "tags.parent = 'true'"
            )
            tags = {
                **ours.data.tags,
                **other_execution_lease(),
                f"lease.exec.{new_token()}": f"{HOST} {os.getppid()} 1",
            }
            theirs.append(
                client.create_run(
                    ours.info.experiment_id, start_time=ours.info.start_time - 50, tags=tags
                ).info.run_id
            )
        real(c)

    monkeypatch.setattr(create_once, "settle", other_creates_meanwhile)
    held = open_study_parent(protocol, path, allow_dirty=True, log=lambda _: None)
    assert held.run_id == theirs[0], "this execution shares the parent that sorts first"
    exp_id = client.get_experiment_by_name("rec").experiment_id
    (ours,) = [
        r
        for r in everything(client, exp_id, f"tags.study_key = '{study_key(protocol)}'")
        if r.info.run_id != theirs[0]
    ]
    assert_withdrawn(client, ours.info.run_id, theirs[0])
    close_study_parent(held, "completed")
    shared = client.get_run(theirs[0])
    assert f"lease.exec.{held.execution_token}" not in shared.data.tags, shared.data.tags


def test_two_executions_closing_one_parent_log_their_counts_at_a_step_each(mlflow_store):
    from tracking.record.executions import execution_step, new_record, record_name
    from tracking.record.sink import RunSink

    client = MlflowClient()
    run = client.create_run(client.create_experiment("rec"))
    sink = RunSink.attach(run, mlflow_store, "rec")
    first, second = new_record("a", "c"), {**new_record("b", "c"), "pid": os.getpid() + 1}
    for record in (first, second):  # both started, both wrote their record, in the same second
        sink.log_record(record, f"executions/{record_name(record)}")
    steps = []
    for record in (second, first):  # the later one closes first
        steps.append(execution_step(client, run.info.run_id, record))
        sink.log_metrics({"cells_finished": 1}, step=steps[-1])
    assert sorted(steps) == [1, 2], steps
    history = [m.step for m in client.get_metric_history(run.info.run_id, "cells_finished")]
    assert sorted(history) == [1, 2], history
    client.log_metric(run.info.run_id, "cells_finished", 1, step=3)  # a recount by `workbench sync`
    third = {**new_record("c", "c"), "pid": os.getpid() + 2}
    sink.log_record(third, f"executions/{record_name(third)}")
    assert execution_step(client, run.info.run_id, third) == 4, (
        "a step already taken gives way to the next free one"
    )
