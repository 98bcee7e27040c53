"""Real servers on 127.0.0.1 for integration tests: PostgreSQL and an MLflow tracking server.

Both are started from temp folders and stopped afterwards. PostgreSQL refuses to run as
root, so as root its commands run as the ``postgres`` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_postgres(cmd: list[str]) -> subprocess.CompletedProcess:
    if os.geteuid() == 0:
        cmd = ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(f"'{c}'" for c in cmd)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def postgres_server(databases=("workbench",)):
    """Yield ``postgresql://postgres@127.0.0.1:PORT`` with the given databases created."""
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL binaries not found (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="wb-pg-"))
    os.chmod(root, 0o777)
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = free_port()
    steps = [
        [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync"],
        [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-o",
         f"-p {port} -h 127.0.0.1 -k {sock} -F", "start"],
    ]
    try:
        for cmd in steps:
            done = _as_postgres(cmd)
            if done.returncode:
                raise RuntimeError(f"{cmd[0]} failed: {done.stdout}{done.stderr}")
        for db in databases:
            _as_postgres([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", db])
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        _as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts: Path, extra_args=(), env=None):
    """An MLflow tracking server on 127.0.0.1 with proxied artifacts; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri,
           "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", *extra_args]
    log = open(artifacts.parent / f"mlflow-server-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not start: {Path(log.name).read_text()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()
