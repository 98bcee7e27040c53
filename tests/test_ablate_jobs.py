"""`ablate --jobs N` (local workers on the cell queue) and the thread count as part of a cell's record."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from studies.ablation.train import train_one
from synthetic import synthetic_data, tiny_config
from test_ablate import write_protocol
from tracking.record.executions import work_line
from workbench.bench.timing import Load
from workbench.train.loop import StopTraining, TrainingObserver

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def study(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    return tmp_path, folder


def ablate(
    tmp_path: Path,
    folder: Path,
    *args: str,
    epochs: int = 2,
    wait: bool = True,
    env: dict | None = None,
):
    protocol = write_protocol(tmp_path, epochs=epochs)
    command = [
        sys.executable,
        "-m",
        "studies.cli",
        "ablate",
        "--protocol",
        str(protocol),
        "--allow-dirty",
        "--device",
        "cpu",
        "--data-path",
        str(folder),
        "--output-dir",
        str(tmp_path / "out"),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if wait:
        return subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
    log = open(tmp_path / f"ablate-{time.monotonic_ns()}.log", "w")
    # SIGINT at its default, as in a terminal: a test run started in the background (CI under
    # nohup) passes SIG_IGN on, and an ablate that ignores SIGINT would rightly never stop.
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ), Path(log.name)


def runs(client: MlflowClient, what: str):
    exp = client.get_experiment_by_name("tiny")
    return client.search_runs([exp.experiment_id], f"tags.{what} = 'true'")


def assert_record_clean(client: MlflowClient, expect_parent: str) -> list:
    parents, cells = runs(client, "parent"), runs(client, "cell")
    assert len(parents) == 1 and parents[0].info.status == expect_parent, [
        (p.info.run_id, p.info.status) for p in parents
    ]
    assert not [r for r in cells if r.info.status == "RUNNING"], "a cell run was left RUNNING"
    assert {r.data.tags["mlflow.parentRunId"] for r in cells} == {parents[0].info.run_id}
    return cells


@pytest.mark.slow  # three processes start torch and MLflow (about 30 s on 2 idle cores)
def test_jobs_train_every_cell_once_under_one_parent_with_a_fixed_thread_count(study):
    tmp_path, folder = study
    done = ablate(tmp_path, folder, "--jobs", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert (
        "2 jobs x 1 thread(s) each" in out
        and "cells: 4 run, 0 already finished (skipped), 0 failed" in out
    ), out[-3000:]
    assert (
        "queue order: most training work first (estimated as FLOPs per image x epochs): cnn first, vit last"
        in out
    ), out[-3000:]
    assert re.search(r"^\[job 1\] cell \d: ", out, re.M) and re.search(
        r"^\[job 2\] cell \d: ", out, re.M
    ), out[-3000:]
    assert not [line for line in out.splitlines() if line.startswith("[job") and "%|" in line], (
        "the workers drew progress bars of their own"
    )
    # stderr is a pipe here, as a log file is: the bar is drawn below each relayed line
    # (tqdm.write) and when its count or a job's cell changes (4 cells, 2 jobs: about a dozen
    # states), not on every pass of the coordinator (before: 106 frames for 27 relayed lines)
    frames = re.findall(r"cells:\s+\d+%\|", done.stderr)
    relayed = [line for line in out.splitlines() if line.startswith("[job")]
    assert 1 <= len(frames) <= len(relayed) + 16, (
        f"{len(frames)} bar frames written to a non-terminal stderr for {len(relayed)} relayed lines"
    )
    cells = assert_record_clean(MlflowClient(), "FINISHED")
    assert sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in cells) == [
        ("cnn", "0"),
        ("cnn", "1"),
        ("vit", "0"),
        ("vit", "1"),
    ]
    assert {r.data.params["threads"] for r in cells} == {"1"}, (
        "every job trains with the fixed default of 1 thread"
    )
    assert not list((tmp_path / "out" / ".jobs").iterdir()), (
        "the execution's queue folder was left behind"
    )

    again = ablate(tmp_path, folder, "--jobs", "2")
    assert (
        again.returncode == 0
        and "cells: 0 run, 4 already finished (skipped), 0 failed" in again.stdout
    ), (again.stdout + again.stderr)[-3000:]


def test_jobs_and_storage_are_refused_together(tmp_path):
    from click.testing import CliRunner

    from studies.ablation.ablate import ablate as ablate_command

    done = CliRunner().invoke(
        ablate_command,
        [
            "--protocol",
            str(write_protocol(tmp_path)),
            "--jobs",
            "2",
            "--storage",
            f"journal:{tmp_path / 'q.log'}",
        ],
    )
    assert done.exit_code == 2 and "give one of them" in done.output, done.output
    assert not (tmp_path / "q.log").exists() and not (tmp_path / "mlflow.db").exists()


def _wait_for_epochs(log: Path, jobs: int, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if all(f"[job {j}] epoch 1:" in text for j in range(1, jobs + 1)):
            return text
        time.sleep(0.2)
    raise AssertionError(
        f"the jobs did not train an epoch in {timeout} s:\n{log.read_text()[-3000:]}"
    )


@pytest.mark.slow  # two real interrupted executions with worker processes (about 40 s)
@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_a_stopped_coordinator_leaves_a_record_the_next_ablate_takes_over(study, how):
    tmp_path, folder = study
    proc, log = ablate(tmp_path, folder, "--jobs", "2", epochs=30, wait=False)
    _wait_for_epochs(log, 2)
    workers = [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
    ]
    assert len(workers) == 2, workers
    os.kill(proc.pid, signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
    assert proc.wait(timeout=150) != 0
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{w}") for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{w}") for w in workers), (
        "a worker outlived its coordinator"
    )
    client = MlflowClient()
    if how == "ctrl-c":
        text = log.read_text()
        assert "stopping 2 job(s) (SIGINT)" in text and "interrupted: parent run" in text, text[
            -3000:
        ]
        cells = assert_record_clean(client, "KILLED")
        killed = [r for r in cells if r.info.status == "KILLED"]
        assert len(killed) == 2 and all(
            "KeyboardInterrupt" in r.data.tags.get("end_reason", "") for r in killed
        ), (
            [
                (r.data.tags["mlflow.runName"], r.info.status, r.data.tags.get("end_reason"))
                for r in cells
            ],
            text.replace("\r", "\n")[-3000:],
        )

    done = ablate(tmp_path, folder, "--jobs", "2", epochs=30)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert len(re.findall(r"resumed from epoch \d+", out)) == 2, out[-4000:]
    cells = assert_record_clean(client, "FINISHED")
    assert sorted(r.info.status for r in cells) == ["FINISHED"] * 4


@pytest.mark.slow  # ablate --jobs 2 with one worker SIGKILLed mid-cell, a replacement and a resume (about 40 s)
def test_a_killed_worker_is_named_and_replaced_and_no_secret_reaches_a_workers_argv_or_environment(
    study,
):
    """Before: the dead worker went unmentioned, nobody took its place, and the study exited 1
    ("their lines above say why") although every cell finished; the workers' argv held the
    queue URL and their environment everything of the coordinator's."""
    from sampler import ArgvSampler

    tmp_path, folder = study
    secret = "unrelated-DBPASS-of-the-shell-31"
    with ArgvSampler(secret) as sampler:
        proc, log = ablate(
            tmp_path, folder, "--jobs", "2", epochs=30, wait=False, env={"DBPASS": secret}
        )
        _wait_for_epochs(log, 2)
        workers = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        assert len(workers) == 2, workers
        for pid in workers:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = dict(
                line.split(b"=", 1)
                for line in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if b"=" in line
            )
            assert b"worker" in argv and not [a for a in argv if a.startswith(b"--storage")], argv
            assert environ[b"WORKBENCH_STORAGE"].startswith(b"journal:"), sorted(environ)
            assert b"DBPASS" not in environ and secret.encode() not in b"".join(environ.values()), (
                sorted(environ)
            )
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    text = log.read_text().replace("\r", "\n")
    sampler.check(seen="worker")
    died = re.findall(
        r"^\[job ([12])\] died \(killed by SIGKILL\) on cell (\S+); started job 3 in its place",
        text,
        re.M,
    )
    assert len(died) == 1, text[-4000:]
    assert (
        "cells: 4 run, 0 already finished (skipped), 0 failed; 1 worker(s) died ([job N] lines above say how), "
        "1 replaced" in text
    ), text[-3000:]
    # the killed worker's cell
    assert len(re.findall(r"resumed from epoch \d+", text)) == 1, text[-4000:]
    client = MlflowClient()
    cells = assert_record_clean(client, "FINISHED")
    assert sorted(r.info.status for r in cells) == ["FINISHED"] * 4
    (parent,) = runs(client, "parent")
    records = [
        json.loads(Path(client.download_artifacts(parent.info.run_id, a.path)).read_text())
        for a in client.list_artifacts(parent.info.run_id, "executions")
    ]
    outcomes = sorted(r["outcome"].split(":")[0] for r in records)
    assert outcomes == ["completed", "died", "worker", "worker"], [r["outcome"] for r in records]
    trained = [r for r in records if r["outcome"].startswith("worker: trained ")]
    assert len(trained) == 2 and sum(r["work"]["ran"] for r in trained) >= 3, [
        r["outcome"] for r in records
    ]
    assert all(r["outcome"] == f"worker: {work_line(r['work'])}" for r in trained)


class _StopAfterEpoch(TrainingObserver):
    """Records the thread count of every epoch and stops the run after ``stop_at`` epochs."""

    def __init__(self, stop_at: int | None) -> None:
        self.stop_at, self.threads = stop_at, []

    def on_epoch(self, metrics: dict) -> None:
        self.threads.append(torch.get_num_threads())
        if self.stop_at is not None and len(self.threads) >= self.stop_at:
            raise StopTraining("test stop")


def test_a_resumed_cell_keeps_its_thread_count_unless_the_user_overrides_it(mlflow_store, tmp_path):
    data, cfg, out = (
        synthetic_data(n_train=64, n_val=32, n_test=16),
        tiny_config(epochs=3),
        tmp_path / "out",
    )
    before = torch.get_num_threads()
    lines: list[str] = []
    try:
        torch.set_num_threads(1)
        first = _StopAfterEpoch(stop_at=1)
        assert (
            train_one(
                cfg,
                data,
                experiment="t",
                output_dir=out,
                run_name="tiny",
                observer=first,
                log=lines.append,
            ).status
            == "stopped"
        )
        torch.set_num_threads(2)  # as a later execution with torch's default on 2 cores
        second = _StopAfterEpoch(stop_at=1)
        assert (
            train_one(
                cfg,
                data,
                experiment="t",
                output_dir=out,
                run_name="tiny",
                observer=second,
                log=lines.append,
            ).status
            == "stopped"
        )
        assert torch.get_num_threads() == 2, "the cell's count must not outlive the cell"
        third = _StopAfterEpoch(stop_at=None)
        done = train_one(
            cfg,
            data,
            experiment="t",
            output_dir=out,
            run_name="tiny",
            observer=third,
            log=lines.append,
            threads=2,
        )
    finally:
        torch.set_num_threads(before)
    assert done.status == "finished", done.message
    assert first.threads == [1] and second.threads == [1], (first.threads, second.threads)
    assert third.threads == [2], third.threads
    assert any("resumes with 1 thread(s), the count it started with" in line for line in lines), (
        lines
    )
    assert any("not bit-identical to an uninterrupted run" in line for line in lines), lines
    run = MlflowClient().get_run(done.run_id)
    assert run.data.params["threads"] == "1"
    assert run.data.tags["threads_changed"] == "started with 1, resumed with 2"


def test_jobs_benchmark_layouts_quick_protocol_and_ratios(tmp_path):
    import click

    from studies.benchmarks.jobs_benchmark import (
        agreement,
        parse_layouts,
        quick_protocol,
        summarize,
    )
    from studies.runtime.study_protocol import load_protocol

    assert parse_layouts("2x1, 1x2") == [(2, 1), (1, 2)]
    for bad in ("2x1", "2x0,1x2", "two,1x2", "2-1,1x2"):
        with pytest.raises(click.BadParameter):
            parse_layouts(bad)
    source = ROOT / "studies" / "protocols" / "cifar10_seed_table.yaml"
    quick = load_protocol(quick_protocol(source, tmp_path, 1000, 200, 1, [0]))
    original = load_protocol(source)
    assert quick.name == "cifar10_seed_table_jobs_benchmark" and tuple(quick.seeds) == (0,), (
        quick.seeds
    )
    assert [a.name for a in quick.arms] == [a.name for a in original.arms]
    assert quick.dataset.train_size == 1000 and quick.dataset.val_size == 200
    assert {c.train_config().run.epochs for c in quick.cells()} == {1}

    cells = {"base/0": 0.5, "p4_w96/0": 0.6}
    rows = [
        {"round": 1, "jobs": 2, "threads": 1, "wall_s": 100.0, "cells": cells},
        {
            "round": 1,
            "jobs": 1,
            "threads": 2,
            "wall_s": 130.0,
            "cells": {"base/0": 0.5, "p4_w96/0": 0.61},
        },
        {"round": 1, "jobs": 1, "threads": 1, "wall_s": 190.0, "cells": dict(cells)},
    ]
    per_layout, text = summarize(rows, (1, 2), "t", Load(3.0, 4.0, 2))
    by = per_layout.set_index("layout")
    assert (
        abs(by.loc["2x1", "cells_per_hour"] - 72.0) < 1e-9
        and abs(by.loc["2x1", "ratio"] - 1.3) < 1e-9
    ), by
    assert "goal at least 1.25 for 2x1 against 1x2 on 2 cores: met" in text, text
    # One round: the ratio is shown, but no verdict is resolved from it.
    assert "layouts: 2x1 vs 1x2: not resolved at this noise; time ratio 0.769" in text, text
    assert "layouts: use: any (not resolved)" in text, text
    assert "load average 3.00 at the start, 4.00 at the end, on 2 cores." in text, text
    assert agreement(rows) == [
        "1 thread(s): layouts 1x1, 2x1 gave the same best validation accuracy in every cell"
    ]


def test_jobs_benchmark_logs_its_verdicts_and_load(mlflow_store, tmp_path):
    from studies.benchmarks.jobs_benchmark import layout_decision, summarize
    from tracking.kinds.benchmark_runs import log_jobs_benchmark

    # Six rounds, 2x1 faster than 1x2 in every one: resolved, and the use line names it.
    rows = [
        {"round": r, "jobs": j, "threads": t, "wall_s": w, "cells": {"a/0": 0.5, "b/0": 0.6}}
        for r in range(1, 7)
        for j, t, w in ((2, 1, 100.0 + r), (1, 2, 130.0 - r))
    ]
    per_layout, text = summarize(rows, (1, 2), "t", Load(5.0, 6.0, 2))
    assert "layouts: 2x1 vs 1x2: faster" in text and "layouts: use: 2x1 (resolved faster" in text
    for name in ("results.csv", "summary.md"):
        (tmp_path / name).write_text(text)
    decision = layout_decision(rows, (1, 2))
    # fmt: skip
    run_id = log_jobs_benchmark(
        per_layout,
        tmp_path,
        {"protocol": "p", "layouts": "2x1,1x2"},
        decision,
        Load(5.0, 6.0, 2).as_dict(),
    )
    run = MlflowClient().get_run(run_id)
    assert run.data.tags["verdict.layouts.2x1_vs_1x2"] == "faster", run.data.tags
    assert run.data.tags["use.layouts"].startswith("2x1 (resolved faster")
    assert run.data.metrics["load/start"] == 5.0 and run.data.metrics["load/end"] == 6.0
    assert run.data.metrics["verdict/layouts/2x1_vs_1x2/high"] < 1.0
