"""deploy/slurm/worker.sbatch under a real SLURM: a 2-task array drains a queue; a signalled task's cell resumes.

A single-node SLURM from Debian's packages (tests/slurm_cluster.py), a real PostgreSQL queue
and a real MLflow server on 127.0.0.1. The array's tasks share one --output-dir, as workers on
one node (or on a shared file system) do. One task gets `scancel --signal=TERM` (what SLURM's
warning signal before the time limit sends) while it is mid-cell; its cell must then be
resumed from the epoch it had reached, not from epoch 0, and the record must hold every cell
exactly once with nothing left RUNNING. Skips, with the reason, where SLURM, munge or
PostgreSQL cannot be had.
"""

from __future__ import annotations

import re
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
from servers import mlflow_server, postgres_server
from slurm_cluster import slurm_cluster, squeue
from studies.ablation.cell_queue import open_storage
from test_ablate import write_protocol

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "deploy" / "slurm" / "worker.sbatch"
EPOCHS = 8
CELLS = [("cnn", "0"), ("cnn", "1"), ("vit", "0"), ("vit", "1")]


def clean(log: Path) -> str:
    """A task's log without its progress bars."""
    if not log.exists():
        return ""
    lines = log.read_text(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(line for line in lines if line.strip() and "it/s" not in line)


def mid_cell(log: Path) -> tuple[str, int] | None:
    """(run name, last epoch logged) of the cell a task is training, once it has an epoch logged and epochs to go."""
    text = clean(log)
    starts = list(re.finditer(r"cell \d+: (\w+)/seed(\d+) \(took it from the queue\)", text))
    if not starts:
        return None
    rest = text[starts[-1].end() :]
    # Not anchored: a progress bar's remains may precede the line ("eepoch 3: ...").
    epochs = [int(e) for e in re.findall(r"epoch (\d+): train loss", rest)]
    if "[finished]" in rest or not epochs or epochs[-1] > EPOCHS - 4:
        return None
    arm, seed = starts[-1].groups()
    return f"{arm}-seed{seed}", epochs[-1]


def wait_for(what: str, condition, logs: list[Path], timeout: float, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(every)
    shown = "".join(f"\n--- {log.name} ---\n{clean(log)[-3000:]}" for log in logs)
    raise AssertionError(f"timed out waiting for {what}{shown}")


def _when(metric) -> tuple[int, int]:
    return metric.timestamp, metric.step


def record_problems(client: MlflowClient, study: optuna.Study) -> list[str]:
    """Where the record departs from every cell finished exactly once, each epoch once, nothing RUNNING."""
    exp = client.get_experiment_by_name("tiny")
    everything = client.search_runs([exp.experiment_id], "")
    cells = [r for r in everything if r.data.tags.get("cell") == "true"]
    finished = [r for r in cells if r.info.status == "FINISHED"]
    problems = []
    keys = sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in finished)
    if keys != CELLS:
        problems.append(f"finished cells {keys}, not each of {CELLS} once")
    for run in cells:
        if run.info.status != "FINISHED" and "superseded_by" not in run.data.tags:
            problems.append(f"run {run.info.run_id}: {run.info.status} and not superseded")
    for run in finished:
        steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy"))
        if sorted(steps) != list(range(1, EPOCHS + 1)) or max(steps.values()) != 1:
            problems.append(f"{run.data.tags['mlflow.runName']}: val_accuracy steps {dict(steps)}")
    running = [r.info.run_id for r in everything if r.info.status == "RUNNING"]
    if running:
        problems.append(f"runs left RUNNING: {running}")
    (parent,) = [r for r in everything if r.data.tags.get("parent") == "true"]
    # Each execution logs its counts at a step of its own, ordered by when it started; the
    # counts logged last in time are those of the execution that ended the study.
    last = {
        key: max(client.get_metric_history(parent.info.run_id, f"cells_{key}"), key=_when).value
        for key in ("finished", "running", "killed", "failed")
    }
    if parent.info.status != "FINISHED" or last != {
        "finished": len(CELLS),
        "running": 0,
        "killed": 0,
        "failed": 0,
    }:
        problems.append(f"parent {parent.info.status}, counts logged last: {last}")
    complete = Counter(
        t.user_attrs["cell"]
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    )
    if sorted(complete) != list(range(len(CELLS))) or set(complete.values()) != {1}:
        problems.append(f"queue trials COMPLETE per cell: {dict(complete)}")
    left = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    if left:
        problems.append(f"queue trials left RUNNING: {left}")
    return problems


def test_a_slurm_array_drains_the_queue_and_a_signalled_task_resumes_its_cell(tmp_path):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=EPOCHS)
    with (
        slurm_cluster() as slurm_env,
        postgres_server(("optuna", "mlflow")) as pg,
        mlflow_server(f"{pg}/mlflow", tmp_path / "artifacts") as url,
    ):
        storage = f"{pg}/optuna"
        # What a user exports before sbatch (docs/remote.md, "SLURM"); sbatch passes it on.
        env = {
            **slurm_env,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MLFLOW_TRACKING_URI": url,
            "WORKBENCH_STORAGE": storage,
            "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
            "WORKBENCH_CMD": f"{sys.executable} -m studies.cli",
            "WORKBENCH_OUTPUT_DIR": str(tmp_path / "out"),  # shared: one node
            "WORKBENCH_DATA_PATH": str(folder),
            "WORKBENCH_WORKER_ARGS": "--heartbeat 2 --grace 10",
        }
        env.pop("MLFLOW_RUN_ID", None)
        queued = subprocess.run(
            [sys.executable, "-m", "studies.cli", "ablate", "--protocol", str(protocol)]
            + ["--allow-dirty", "--storage-env", "WORKBENCH_STORAGE"],
            env=env,
            cwd=tmp_path,
            text=True,
            capture_output=True,
            timeout=300,
        )
        assert queued.returncode == 0 and "queued 4 cells" in queued.stdout, (
            queued.stdout + queued.stderr
        )
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--array=0-1", "--cpus-per-task=1", "--time=30"]
            + [f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%A_%a.log", str(SBATCH)],
            env=env,
            text=True,
            capture_output=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        job = submitted.stdout.strip().split(";")[0]
        logs = [tmp_path / f"slurm-{job}_{task}.log" for task in (0, 1)]

        def a_task_mid_cell():
            for task, log in enumerate(logs):
                found = mid_cell(log)
                if found:
                    return task, *found
            return None

        task, run_name, last_epoch = wait_for(
            "a task mid-cell", a_task_mid_cell, logs, timeout=600, every=0.05
        )
        cancel = subprocess.run(
            ["scancel", "--signal=TERM", f"{job}_{task}"], env=env, capture_output=True, text=True
        )
        assert cancel.returncode == 0, cancel.stderr
        wait_for(
            "every array task to end", lambda: not squeue(env, job), logs, timeout=900, every=1
        )

        texts = [clean(log) for log in logs]
        for log, text in zip(logs, texts):
            assert "Traceback" not in text and "[failed]" not in text, (
                f"{log.name}:\n{text[-4000:]}"
            )
        # The signalled cell went on from the epoch it had reached (its checkpoint), in some task.
        resumed = [
            int(m.group(1))
            for text in texts
            for m in re.finditer(rf"(?<![\w-]){run_name}: resumed from epoch (\d+) step \d+", text)
        ]
        assert resumed and resumed[-1] >= last_epoch >= 1, (
            f"{run_name} signalled after epoch {last_epoch}, resumed at {resumed}\n"
            + "\n".join(f"--- {log.name} ---\n{text[-3000:]}" for log, text in zip(logs, texts))
        )
        study = optuna.load_study(
            study_name=next(
                s.study_name
                for s in optuna.get_all_study_summaries(storage)
                if s.study_name.startswith("cells:")
            ),
            storage=open_storage(storage, 2, 10),
        )
        problems = record_problems(MlflowClient(url), study)
        assert not problems, "\n".join(problems) + "".join(
            f"\n--- {log.name} ---\n{text[-3000:]}" for log, text in zip(logs, texts)
        )
