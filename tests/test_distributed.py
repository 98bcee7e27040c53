"""Distributed ablation: cells queued in Optuna, workers killed, paused past the grace period, re-queued by hand.

Real processes against a real MLflow tracking server on 127.0.0.1, with the queue in a real
PostgreSQL or in a journal file. Every cell must finish exactly once: one finished run per
cell, each epoch logged once, one logged model per run, no crashed live worker, nothing
RUNNING. The paused worker's run is closed as superseded (its holder was alive, so it may
still land a late point there) and its cell finishes in a new run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from data_fixtures import make_image_folder
from studies.ablation.cell_queue import open_storage
from servers import mlflow_server, postgres_server
from test_ablate import write_protocol

# a long kill test with servers: slow tier (the default tier keeps test_train's SIGKILL resume)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
]
ROOT = Path(__file__).resolve().parent.parent
EPOCHS = 16


STARTED: list[subprocess.Popen] = []


def start(args: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "studies.cli", *args],
        env=env,
        cwd=cwd,
        text=True,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    """A failing test must not leave a paused or running worker behind."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def wait_for(
    what: str,
    condition,
    timeout: float = 300,
    every: float = 0.2,
    logs: dict[str, Path] | None = None,
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(every)
    shown = "".join(
        f"\n--- {name} worker (end) ---\n{tail(log)}" for name, log in (logs or {}).items()
    )
    raise AssertionError(f"timed out waiting for {what}{shown}")


def tail(log: Path, chars: int = 2500) -> str:
    """The end of a worker's log without its progress bars (CI once showed only 'timed out')."""
    if not log.exists():
        return "(no log)"
    lines = [
        line
        for line in log.read_text().replace("\r", "\n").splitlines()
        if line.strip() and "it/s" not in line
    ]
    return "\n".join(lines)[-chars:]


def epochs_done(log: Path) -> int:
    return len(re.findall(r"^epoch \d+:", log.read_text(), re.M)) if log.exists() else 0


def mid_cell(log: Path) -> str | None:
    """The cell a worker is training now, once it has logged an epoch of it and has epochs to go."""
    text = log.read_text()
    starts = list(re.finditer(r"^cell (\d+): ", text, re.M))
    if not starts:
        return None
    rest = text[starts[-1].end() :]
    epochs = [int(e) for e in re.findall(r"^epoch (\d+):", rest, re.M)]
    if "[finished]" in rest or not epochs or epochs[-1] > EPOCHS - 3:
        return None
    return starts[-1].group(1)


def describe(client: MlflowClient, runs, study: optuna.Study, logs: dict[str, Path]) -> str:
    """Everything needed to tell what happened when the record is not as expected."""
    lines = ["runs:"]
    for run in runs:
        tags = run.data.tags
        lines.append(
            f"  {run.info.run_id} {tags.get('arm')}/seed{tags.get('seed')} {run.info.status} "
            f"epochs={sorted(m.step for m in client.get_metric_history(run.info.run_id, 'val_accuracy'))} "
            + " ".join(
                f"{k}={v!r}"
                for k, v in sorted(tags.items())
                if k.startswith(
                    (
                        "lease.",
                        "killed_reason",
                        "superseded",
                        "continues",
                        "end_reason",
                        "resumed",
                        "sync.",
                        "stopped",
                        "failure",
                    )
                )
            )
        )
    lines.append("trials:")
    for t in study.get_trials(deepcopy=False):
        lines.append(f"  #{t.number} {t.state.name} {dict(t.user_attrs)}")
    for name, log in logs.items():
        text = log.read_text() if log.exists() else "(no log)"
        lines.append(f"--- {name} worker ---\n{text[-6000:]}")
    return "\n".join(lines)


def assert_exactly_once(
    client: MlflowClient,
    experiment: str,
    study: optuna.Study,
    paused_seed_arm,
    logs: dict[str, Path],
) -> None:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], "tags.cell = 'true'")
    try:
        _assert_exactly_once(client, exp, runs, study, paused_seed_arm)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{describe(client, runs, study, logs)}") from None


def _assert_exactly_once(
    client: MlflowClient, exp, runs, study: optuna.Study, paused_seed_arm
) -> None:
    finished = [r for r in runs if r.info.status == "FINISHED"]
    keys = sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in finished)
    assert keys == sorted([("vit", "0"), ("cnn", "0"), ("vit", "1"), ("cnn", "1")]), keys
    # The paused worker's run, and only that one, was closed as superseded by its cell's finished run.
    (old,) = [r for r in runs if r.info.status != "FINISHED"]
    assert (
        old.info.status == "KILLED"
        and (old.data.tags["arm"], old.data.tags["seed"]) == paused_seed_arm
    )
    (new,) = [r for r in finished if r.data.tags["run_key"] == old.data.tags["run_key"]]
    assert (
        old.data.tags["superseded_by"] == new.info.run_id
        and new.data.tags["continues_run"] == old.info.run_id
    )
    for run in runs:
        name = run.data.tags["mlflow.runName"]
        for key in run.data.metrics:
            steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert max(steps.values()) == 1, f"{name} {key}: duplicated steps {dict(steps)}"
        models = client.search_logged_models(
            [exp.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'"
        )
        if run is old:
            assert not models, (name, models)
            continue
        assert sorted(
            m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")
        ) == list(range(1, EPOCHS + 1))
        assert [str(m.status).split(".")[-1] for m in models] == ["READY"], (name, models)
    everything = client.search_runs([exp.experiment_id], "")
    assert not [r.info.run_id for r in everything if r.info.status == "RUNNING"]
    (parent,) = [r for r in everything if r.data.tags.get("parent") == "true"]
    # Counted by cell: the superseded run does not make the study look failed.
    assert parent.info.status == "FINISHED", (parent.info.status, parent.data.metrics)
    assert (
        parent.data.metrics["cells_finished"] == 4 and parent.data.metrics["cells_superseded"] == 1
    ), parent.data.metrics
    complete = Counter(
        t.user_attrs["cell"]
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    )
    assert sorted(complete) == [0, 1, 2, 3] and set(complete.values()) == {1}, complete


@pytest.mark.parametrize("queue", ["postgresql", "journal"])
def test_killed_paused_and_requeued_workers_every_cell_exactly_once(queue, tmp_path, monkeypatch):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=EPOCHS)
    with (
        postgres_server(("optuna", "mlflow")) as pg,
        mlflow_server(f"{pg}/mlflow", tmp_path / "artifacts") as url,
    ):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MLFLOW_TRACKING_URI": url,
            "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
            "OMP_NUM_THREADS": "1",
        }
        env.pop("MLFLOW_RUN_ID", None)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        storage = f"{pg}/optuna" if queue == "postgresql" else f"journal:{tmp_path / 'queue.log'}"
        queued = subprocess.run(
            [
                sys.executable,
                "-m",
                "studies.cli",
                "ablate",
                "--protocol",
                str(protocol),
                "--allow-dirty",
                "--storage",
                storage,
            ],
            env=env,
            cwd=tmp_path,
            text=True,
            capture_output=True,
            timeout=300,
        )
        assert queued.returncode == 0 and "queued 4 cells" in queued.stdout, (
            queued.stdout + queued.stderr
        )
        common = [
            "worker",
            "--storage",
            storage,
            "--data-path",
            str(folder),
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "out"),
            "--heartbeat",
            "2",
            "--grace",
            "10",
        ]
        logs = {
            name: tmp_path / f"{name}.log" for name in ("killed", "paused", "steady", "requeue")
        }
        killed = start(common, env, tmp_path, logs["killed"])
        paused = start(common, env, tmp_path, logs["paused"])
        steady = start(common, env, tmp_path, logs["steady"])
        victims = wait_for(
            "two workers mid-cell",
            lambda: (
                (mid_cell(logs["killed"]), mid_cell(logs["paused"]))
                if mid_cell(logs["killed"]) and mid_cell(logs["paused"])
                else None
            ),
            every=0.05,
            logs=logs,
        )
        # Paused right after an epoch line: the moment between the lease check and the metric upload
        # is the one that fencing alone cannot close (MLflow has no conditional write).
        os.killpg(killed.pid, signal.SIGKILL)
        os.killpg(paused.pid, signal.SIGSTOP)
        killed.wait(timeout=60)
        killed_cell, paused_cell = map(int, victims)
        # By hand, while the steady worker is busy and alive: only the expired leases are re-queued.
        requeue = start([*common, "--requeue-stale"], env, tmp_path, logs["requeue"])
        wait_for(
            "the --requeue-stale report",
            lambda: re.search(r"re-queued (\d+) cells", logs["requeue"].read_text()),
            logs=logs,
        )
        study = optuna.load_study(
            study_name=f"cells:tiny@{_short_hash(protocol)}", storage=open_storage(storage, 2, 10)
        )
        # Past the grace period a live worker hands the paused worker's cell on and another one takes it.
        wait_for(
            "the paused cell taken over",
            lambda: any(
                t.user_attrs.get("cell") == paused_cell and t.user_attrs.get("retry_of") is not None
                for t in study.get_trials(
                    deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE)
                )
            ),
            timeout=300,
            logs=logs,
        )
        os.killpg(paused.pid, signal.SIGCONT)
        outputs = {}
        for name, proc in (("paused", paused), ("steady", steady), ("requeue", requeue)):
            proc.wait(timeout=900)
            outputs[name] = logs[name].read_text()
            assert proc.returncode == 0, f"{name} worker:\n{outputs[name][-4000:]}"
            assert "Traceback" not in outputs[name] and "[failed]" not in outputs[name], (
                f"{name} worker:\n{outputs[name][-4000:]}"
            )
        # Up to its kill, the killed worker failed nothing either (a failed cell is never retried by the queue).
        killed_log = logs["killed"].read_text()
        assert "Traceback" not in killed_log and "[failed]" not in killed_log, killed_log[-4000:]
        # Each dead or paused worker's cell was handed on exactly once; no live worker's cell ever was.
        requeued = sorted(
            int(c)
            for text in outputs.values()
            for c in re.findall(r"^re-queued cell (\d+) ", text, re.M)
        )
        assert requeued == sorted([killed_cell, paused_cell]), requeued
        assert re.search(rf"cell {paused_cell}: stopped, lease lost: ", outputs["paused"]), outputs[
            "paused"
        ][-3000:]
        paused_run = re.search(rf"^cell {paused_cell}: (\w+)/seed(\d+)", outputs["paused"], re.M)
        assert paused_run, outputs["paused"][-3000:]
        assert (
            assert_exactly_once(MlflowClient(url), "tiny", study, paused_run.groups(), logs) is None
        )


def _short_hash(protocol_path: Path) -> str:
    from studies.runtime.study_protocol import load_protocol

    return load_protocol(protocol_path).short_hash
