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
def postgres_server(databases=("workbench",), password: str | None = None):
    """Yield ``postgresql://postgres@127.0.0.1:PORT`` with the given databases created.

    ``password``: TCP connections need it (scram-sha-256), as on a real server; the URL
    yielded holds none (give it in the URL, PGPASSWORD or a password file). Without it,
    loopback is trusted.
    """
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
    auth = ["-A", "trust"]
    if password is not None:
        (root / "pw").write_text(password + "\n")
        if os.geteuid() == 0:
            shutil.chown(root / "pw", "postgres")
        auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={root / 'pw'}"]
    steps = [
        [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", *auth, "--no-sync"],
        [
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-o",
            f"-p {port} -h 127.0.0.1 -k {sock} -F",
            "start",
        ],
    ]
    try:
        for cmd in steps:
            done = _as_postgres(cmd)
            if done.returncode:
                raise RuntimeError(f"{cmd[0]} failed: {done.stdout}{done.stderr}")
        for db in databases:  # through the socket: trusted either way
            _as_postgres(
                [str(bindir / "createdb"), "-h", str(sock), "-p", str(port), "-U", "postgres", db]
            )
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        _as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(root, ignore_errors=True)


class ServerProcess:
    """A server subprocess in its own process group: started, killed (SIGKILL) and started again."""

    def __init__(self, cmd: list[str], env: dict, port: int, log_path: Path) -> None:
        self.cmd, self.env, self.port, self.log_path = cmd, env, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"mlflow server did not start: {self.log_path.read_text()[-3000:]}"
                    ) from None
                time.sleep(0.3)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        """SIGKILL the whole server (it has worker processes): the outage the tests simulate."""
        self._signal(9)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self._signal(15)
        try:
            # a graceful uvicorn shutdown can take long; the data is committed
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts: Path, extra_args=(), env=None):
    """An MLflow tracking server on 127.0.0.1 with proxied artifacts; yields its URL."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        backend_uri,
        "--artifacts-destination",
        str(artifacts),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        *extra_args,
    ]
    # MLflow's job runner starts about ten consumer processes in sessions of their own (out of
    # reach of the server's process group, and a CPU cost every test pays); nothing here uses it.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
    server = ServerProcess(
        cmd, {**os.environ, **env}, port, artifacts.parent / f"mlflow-server-{port}.log"
    )
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def workbench_server(
    backend_uri: str, artifacts: Path, admin: tuple[str, str] | None, auth_db: str | None = None
):
    """The server as ``workbench server start`` runs it (basic-auth when ``admin`` is given); yields a ServerProcess.

    The auth ini stays in place until the context ends, so the test may kill and start
    the server again on the same port, backend and artifact store.
    """
    from tracking.server.server_config import ServerConfig, prepared_server

    cfg = ServerConfig(
        backend_uri,
        str(artifacts),
        port=free_port(),
        workers=1,
        auth=admin is not None,
        auth_database_uri=auth_db,
    )
    user, password = admin or (None, None)
    with prepared_server(cfg, user, password) as (cmd, env):
        server = ServerProcess(
            cmd, env, cfg.port, artifacts.parent / f"mlflow-server-{cfg.port}.log"
        )
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def isolated_tracking(tmp_path, monkeypatch):
    """Fallback store in tmp_path, no remembered server state, no credentials from the caller's shell."""
    from tracking.store import offline_store

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    for key in (
        "MLFLOW_RUN_ID",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
    ):
        monkeypatch.delenv(key, raising=False)
    # A URI an earlier test set with mlflow.set_tracking_uri would outrank MLFLOW_TRACKING_URI
    # for every MlflowClient() here: the test's own environment decides, as in a fresh process.
    from mlflow.tracking._tracking_service import utils as tracking_utils

    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)
    offline_store.forget_health()
    yield tmp_path / "offline"
    offline_store.forget_health()
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Launcher:
    """``workbench server start ARGS`` as a subprocess (the real launcher), in a session of its own."""

    def __init__(self, args: list[str], env: dict, log_path: Path) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        self.cmd = [sys.executable, "-m", "studies.cli", "server", "start", *args]
        self.env = {
            **env,
            "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p),
        }
        self.cwd, self.log_path = root, log_path
        self.port = int(args[args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def start(self, timeout: float = 180) -> None:
        """Until the launcher printed its ready line; RuntimeError (with its output) if it exited first."""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while "ready: " not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"workbench server start failed: {self.output()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        """SIGTERM to the launcher (it stops its server); SIGKILL to everything left after 30 s."""
        if self.proc is None:
            return
        below = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                if running(pid):
                    os.kill(pid, 9)
