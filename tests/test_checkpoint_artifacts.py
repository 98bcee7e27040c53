"""A cell's checkpoint in its run's artifact store: uploaded each epoch and at a preemption's step, the
older ones pruned, fetched by an execution with an empty output folder, refused when damaged."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from studies.ablation.train import train_one
from studies.runtime.stop_signals import Preempted, sigterm_raises, stops_at_step_boundaries
from synthetic import synthetic_data, tiny_config
from tracking.kinds.checkpoint_artifacts import MANIFEST, fetch_checkpoint, latest_uploaded
from tracking.record.sink import RunSink
from workbench.train.checkpoint import load_checkpoint
from workbench.train.loop import TrainingObserver

BATCHES = 2  # 64 training images in batches of 32


class SignalAtStep(TrainingObserver):
    """Sends this process ``signum`` when the loop checks before global step ``step`` (0-based)."""

    def __init__(self, step: int, signum: int = signal.SIGUSR1) -> None:
        self.step, self.signum, self.checks = step, signum, 0

    def check(self, sync: bool = False) -> None:
        if sync:
            return
        if self.checks == self.step:
            os.kill(os.getpid(), self.signum)
        self.checks += 1


def assert_same_state(a: dict, b: dict, what: str) -> None:
    for key, tensor in a.items():
        diff = (tensor.double() - b[key].double()).abs().max().item()
        assert torch.equal(tensor, b[key]), f"{what} {key}: max |difference| {diff:.3g} (must be 0)"


def the_run(experiment: str):
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


@pytest.mark.slow  # three trainings in a row: the default tier keeps the damaged-upload test
def test_a_preempted_cell_uploads_its_step_and_resumes_there_elsewhere_bit_identically(
    mlflow_store, tmp_path
):
    data = synthetic_data(n_train=64, n_val=32, n_test=16)
    cfg = tiny_config(epochs=2)
    lines: list[str] = []
    step = BATCHES + 1  # epoch 2, after its first batch
    with sigterm_raises(preemptible=True), pytest.raises(Preempted, match="SIGUSR1"):
        train_one(
            cfg,
            data,
            experiment="cells",
            output_dir=tmp_path / "machine-a",
            run_name="tiny",
            observer=SignalAtStep(step),
            log=lines.append,
        )
    client, run = the_run("cells")
    assert run.info.status == "KILLED" and run.data.tags["end_reason"].startswith("Preempted"), (
        run.data.tags
    )
    # The step reached is the checkpoint in the run; epoch 1's, uploaded before, was pruned.
    assert [f.path for f in client.list_artifacts(run.info.run_id, "resume")] == [
        f"resume/step-{step:09d}"
    ]
    tags = run.data.tags
    assert (tags["checkpoint.epoch"], tags["checkpoint.step"]) == ("1", str(step)), tags
    assert tags["checkpoint.uri"].endswith(f"/resume/step-{step:09d}"), tags
    assert any(f"checkpoint of epoch 1 batch 1 (step {step}) uploaded" in line for line in lines)

    # Another machine (an empty output folder) continues the run from that step.
    lines.clear()
    outcome = train_one(
        cfg,
        data,
        experiment="cells",
        output_dir=tmp_path / "machine-b",
        run_name="tiny",
        log=lines.append,
    )
    assert outcome.status == "finished", outcome.message
    assert any(f"resumed from epoch 1 step {step}" in line for line in lines), lines
    assert any(f"fetched the checkpoint of epoch 1 (step {step})" in line for line in lines), lines
    client, run = the_run("cells")
    assert not client.list_artifacts(run.info.run_id, "resume")  # finished: pruned entirely
    assert run.data.tags["checkpoint.uri"].endswith("/checkpoints"), run.data.tags

    straight = train_one(
        cfg,
        data,
        experiment="straight",
        output_dir=tmp_path / "straight",
        run_name="tiny",
        log=lambda line: None,
    )
    assert straight.status == "finished", straight.message
    (key,) = [p.name for p in (tmp_path / "machine-b").iterdir()]
    a = load_checkpoint(tmp_path / "straight" / key / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "machine-b" / key / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 2 * BATCHES and a["finished"] and b["finished"]
    assert_same_state(a["model"], b["model"], "model")
    for n, (s1, s2) in enumerate(
        zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values())
    ):
        assert_same_state(s1, s2, f"optimizer state {n}")


def test_a_damaged_upload_is_refused_and_one_without_manifest_never_used(mlflow_store, tmp_path):
    data = synthetic_data(n_train=64, n_val=32, n_test=16)
    with sigterm_raises(preemptible=True), pytest.raises(Preempted):
        train_one(
            tiny_config(epochs=2),
            data,
            experiment="cells",
            output_dir=tmp_path / "a",
            run_name="tiny",
            observer=SignalAtStep(BATCHES),  # at epoch 2's first step: epoch 1's checkpoint is it
            log=lambda line: None,
        )
    client, run = the_run("cells")
    sink = RunSink.attach(run, mlflow_store, "cells")
    folder = Path(run.info.artifact_uri.removeprefix("file://")) / f"resume/step-{BATCHES:09d}"
    good = fetch_checkpoint(sink, tmp_path / "b", lambda line: None)
    assert (good.epoch, good.step, good.batch) == (1, BATCHES, 0)
    # A byte changed in the store: refused by name, nothing put in place.
    stored = folder / "last.pt"
    raw = bytearray(stored.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    stored.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"last.pt: sha256 .* the uploaded checkpoint is damaged"):
        fetch_checkpoint(sink, tmp_path / "c", lambda line: None)
    assert not (tmp_path / "c" / "checkpoints" / "last.pt").exists()
    # An upload cut short before its manifest: not a checkpoint at all.
    (folder / MANIFEST).unlink()
    assert latest_uploaded(client, run.info.run_id, tmp_path / "d") is None
    assert fetch_checkpoint(sink, tmp_path / "e", lambda line: None) is None


def test_a_preemption_waits_for_the_step_boundary_only_inside_training():
    with sigterm_raises(preemptible=True):
        with pytest.raises(Preempted, match="SIGTERM"):  # outside training: at once
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    with sigterm_raises(preemptible=True):
        reached = []
        with pytest.raises(Preempted, match="SIGUSR1"):
            with stops_at_step_boundaries():
                os.kill(os.getpid(), signal.SIGUSR1)
                reached.append("the step went on")  # not cut by the handler
        assert reached == ["the step went on"]
    with sigterm_raises():  # not a worker: SIGTERM is Terminated, SIGUSR1 left alone
        assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)
