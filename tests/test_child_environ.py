"""The environment a child really gets, read from ``/proc/<pid>/environ``: the ``git`` calls that
read the checkout's commit and the ``ablate --jobs`` workers hold no secret they do not use.

The parent's environment holds what a launcher's shell may: the tracking account's password, a
tracking URI and a queue URL with passwords, ``PGPASSWORD``, an unrelated ``DBPASS``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from studies.ablation.jobs import start_job, worker_environment
from tracking.store.session import git_state

SECRETS = {
    "MLFLOW_TRACKING_PASSWORD": "acct-Secret-49",
    "MLFLOW_TRACKING_URI": "postgresql://mlflow:uri-Secret-49@127.0.0.1:1/mlflow",
    "WORKBENCH_STORAGE": "postgresql://optuna:queue-Secret-49@127.0.0.1:1/optuna",
    "PGPASSWORD": "pg-Secret-49",
    "DBPASS": "db-Secret-49",
}


def environ_of(dump: Path) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in dump.read_bytes().decode().split("\0") if item)
    return dict(pairs)


def leaked(environ: dict[str, str]) -> list[str]:
    """The variables holding any of the secrets."""
    return sorted(k for k, v in environ.items() if "Secret-49" in v)


@pytest.fixture
def git_that_dumps_its_environment(tmp_path, monkeypatch):
    """A ``git`` first on PATH that copies its own /proc/<pid>/environ, then runs the real git."""
    real = shutil.which("git")
    if real is None:
        pytest.skip("no git on this machine")
    bin_dir, dump = tmp_path / "bin", tmp_path / "git-environ"
    bin_dir.mkdir()
    wrapper = bin_dir / "git"
    wrapper.write_text(f'#!/bin/sh\ncat /proc/$$/environ > "{dump}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    return dump


def test_git_gets_no_secret_of_its_parent(git_that_dumps_its_environment):
    dump = git_that_dumps_its_environment
    state = git_state()
    environ = environ_of(dump)
    assert len(state["git_commit"]) == 40 and state["git_dirty"] in ("true", "false"), state
    assert not leaked(environ), f"secrets in git's environment: {leaked(environ)}"
    assert environ["PATH"] == os.environ["PATH"], "git finds itself and its helpers"
    # The same wrapper run with the parent's whole environment shows every secret: the dump sees them.
    subprocess.run(["git", "--version"], check=True, capture_output=True)
    assert set(leaked(environ_of(dump))) == set(SECRETS), sorted(environ_of(dump))


@pytest.mark.parametrize(
    "tracking, queue, pgpassword",
    [
        ("http://127.0.0.1:1", "journal:{tmp}/queue.log", False),  # what `ablate --jobs` uses
        ("postgresql://mlflow@127.0.0.1:1/mlflow", "journal:{tmp}/queue.log", True),
    ],
)
def test_a_jobs_worker_gets_pgpassword_only_where_postgresql_is_used(
    tmp_path, monkeypatch, tracking, queue, pgpassword
):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    storage = queue.format(tmp=tmp_path)
    job = start_job(
        0, [sys.executable, "-c", "import time; time.sleep(60)"], worker_environment(storage)
    )
    proc = Path(f"/proc/{job.process.pid}")
    try:
        # Popen returns once the child exec'd: its environ is now the one it was given.
        assert "time.sleep(60)" in (proc / "cmdline").read_bytes().decode()
        environ = environ_of(proc / "environ")
    finally:
        job.process.kill()
        job.process.wait(timeout=30)
    assert environ["WORKBENCH_STORAGE"] == storage, "its queue comes as WORKBENCH_STORAGE"
    assert ("PGPASSWORD" in environ) == pgpassword, sorted(environ)
    unused = [k for k in ("MLFLOW_TRACKING_PASSWORD", "DBPASS") if k in environ]
    assert unused == ["MLFLOW_TRACKING_PASSWORD"], "the tracking account passes, nothing else"
    other = [k for k, v in environ.items() if "queue-Secret" in v or "db-Secret" in v]
    assert not other, other
