"""PostgreSQL connections a worker holds on the queue's database, measured in pg_stat_activity.

Real workers (subprocesses) drain a tiny queue in a real PostgreSQL, with a real MLflow server
on its own database of the same PostgreSQL. A monitor samples pg_stat_activity every 20 ms
and keeps, per worker (libpq's application_name, from PGAPPNAME) and in all, the most
connections seen on the queue's database. docs/remote.md, "Many workers", states the budget
this test holds a worker to and the figures of its 16-worker run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.storages import RDBStorage

from data_fixtures import make_image_folder
from servers import mlflow_server, postgres_server
from studies.ablation.cell_queue import engine_kwargs
from test_ablate import write_protocol

pytestmark = [pytest.mark.integration]
ROOT = Path(__file__).resolve().parent.parent
# What one worker may hold on the queue's database (docs/remote.md, "Many workers").
BUDGET_PER_WORKER = 2


class ConnectionMonitor:
    """Samples pg_stat_activity in a thread: the peak per application_name and in all, on one database."""

    def __init__(self, server: str, database: str, every: float = 0.02) -> None:
        self.server, self.database, self.every = server, database, every
        self.peak_by_app: Counter = Counter()
        self.peak_total = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psycopg

        # The monitor's own connection is to another database ("postgres"), so it is never counted.
        with psycopg.connect(f"{self.server}/postgres", autocommit=True) as conn:
            while not self._stop.is_set():
                # Client backends only: an autovacuum worker also shows the database's name.
                rows = conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity "
                    "WHERE datname = %s AND backend_type = 'client backend' GROUP BY application_name",
                    (self.database,),
                ).fetchall()
                for app, n in rows:
                    self.peak_by_app[app] = max(self.peak_by_app[app], n)
                self.peak_total = max(self.peak_total, sum(n for _, n in rows))
                self.samples += 1
                time.sleep(self.every)

    def __enter__(self) -> ConnectionMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def drain_with_workers(
    tmp_path: Path, workers: int, epochs: int = 2
) -> tuple[ConnectionMonitor, list[str]]:
    """Queue the 4-cell tiny protocol, drain it with ``workers`` workers; the queue database's monitor and their logs."""
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=epochs)
    with (
        postgres_server(("optuna", "mlflow")) as pg,
        mlflow_server(f"{pg}/mlflow", tmp_path / "artifacts") as url,
    ):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "MLFLOW_TRACKING_URI": url,
            "WORKBENCH_STORAGE": f"{pg}/optuna",
            "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
        }
        env.pop("MLFLOW_RUN_ID", None)
        queued = subprocess.run(
            [sys.executable, "-m", "studies.cli", "ablate", "--protocol", str(protocol)]
            + ["--allow-dirty", "--storage-env", "WORKBENCH_STORAGE"],
            env=env,
            cwd=tmp_path,
            text=True,
            capture_output=True,
            timeout=900,  # minutes where 2 cores are shared by a dozen processes
        )
        assert queued.returncode == 0, queued.stdout + queued.stderr
        args = [sys.executable, "-m", "studies.cli", "worker", "--device", "cpu", "--threads", "1"]
        args += ["--data-path", str(folder), "--output-dir", str(tmp_path / "out")]
        # A grace that a live worker on a loaded machine never misses (at load 18, 10 s was missed).
        args += ["--heartbeat", "5", "--grace", "120"]
        logs = [tmp_path / f"worker-{i}.log" for i in range(workers)]
        started = time.monotonic()
        with ConnectionMonitor(pg, "optuna") as monitor, ConnectionMonitor(pg, "mlflow") as server:
            procs = [
                subprocess.Popen(
                    args,
                    env={**env, "PGAPPNAME": f"worker-{i}"},
                    cwd=tmp_path,
                    stdout=open(log, "w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                for i, log in enumerate(logs)
            ]
            try:
                for proc in procs:
                    proc.wait(timeout=1200)
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait(timeout=30)
        texts = [log.read_text() for log in logs]
        for proc, text in zip(procs, texts):
            assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
        print(
            f"\n{workers} worker(s) drained the queue in {time.monotonic() - started:.0f} s; the MLflow "
            f"server (one process, its own database): peak {server.peak_total} connections"
        )
        return monitor, texts


@pytest.mark.slow  # 16 workers start at once: minutes on 2 cores
@pytest.mark.parametrize("workers", [1, 16])
def test_a_worker_holds_no_more_queue_connections_than_its_budget(tmp_path, workers):
    monitor, texts = drain_with_workers(tmp_path, workers)
    ran = sum(int(t.rsplit("worker ran ", 1)[1].split()[0]) for t in texts)
    assert ran == 4, [t[-500:] for t in texts]
    apps = {app: n for app, n in monitor.peak_by_app.items() if app.startswith("worker-")}
    # Every worker was seen holding a connection (the monitor samples fast enough to see them).
    assert len(apps) == workers and monitor.samples > 50, (apps, monitor.samples)
    over = {app: n for app, n in apps.items() if n > BUDGET_PER_WORKER}
    print(
        f"\n{workers} worker(s): peak {monitor.peak_total} connections on the queue's database, "
        f"per worker at most {max(apps.values())} (budget {BUDGET_PER_WORKER}), {monitor.samples} samples"
    )
    assert not over, f"workers over the budget of {BUDGET_PER_WORKER}: {over}"
    assert monitor.peak_total <= BUDGET_PER_WORKER * workers, monitor.peak_total


def connections_left(server: str, kwargs: dict, name: str) -> tuple[int, int]:
    """(most connections seen, connections left open) on the queue database while two threads of
    this process run queue operations on an RDBStorage built with ``kwargs``, as a worker's two do."""
    storage = RDBStorage(f"{server}/optuna", engine_kwargs=kwargs)
    study = optuna.create_study(storage=storage, study_name=name)
    with ConnectionMonitor(server, "optuna", every=0.005) as monitor:

        def operations() -> None:
            for i in range(20):
                trial = study.ask()
                trial.set_user_attr("lease", i)
                study.tell(trial, float(i))

        threads = [threading.Thread(target=operations) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.3)  # a few samples after the last operation
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        (left,) = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'optuna' "
            "AND backend_type = 'client backend'"
        ).fetchone()
    storage.engine.dispose()
    return monitor.peak_total, left


@pytest.mark.slow  # a PostgreSQL cluster started for one check: 5 s, kept out of the default tier's 5 minutes
def test_the_queue_holds_no_connection_between_operations():
    """Without a pool, two threads at work hold at most 2 connections and none afterwards;
    SQLAlchemy's default pool (the queue's engine before) keeps them open."""
    with postgres_server(("optuna",)) as pg:
        peak, left = connections_left(pg, engine_kwargs(f"{pg}/optuna"), "no-pool")
        # pg_stat_activity still lists a closed connection's backend while it exits, so one more
        # can show for an instant as the next operation connects (seen once at load 20: 3)
        assert peak <= BUDGET_PER_WORKER + 1 and left == 0, (peak, left)
        peak, left = connections_left(pg, {"pool_pre_ping": True}, "pooled")
        assert left >= 1, (peak, left)  # the bad case: held after the work is done
