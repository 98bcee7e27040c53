"""Running ``mlflow server`` so that it fails loudly and leaves nothing behind.

- Before anything starts, the port is bound once: a port in use is an error (exit 1), not
  a server that logs "Address already in use" and exits 0.
- The server runs in a process group of its own (it has worker processes). It gets a
  parent-death signal (Linux ``PR_SET_PDEATHSIG``), and a watchdog process holding one
  end of a pipe from the launcher stops the whole group and removes the runtime folder
  when that pipe closes: when the launcher exits in any way, SIGKILL included.
- The launcher waits until ``/health`` answers, then prints one line; a server that exits
  before that is an error with its exit code (never 0).
- Private files live in a runtime folder (mode 0700) per launch, removed on exit; folders
  of launchers that died anyway are removed at the next start.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from tracking.record.lease import pid_alive
from tracking.store.child_env import watchdog_env

RUNTIME_ENV = "WORKBENCH_SERVER_RUNTIME_DIR"
START_TIMEOUT = 180.0
WATCHDOG = Path(__file__).with_name("server_watchdog.py")


class ServerStartError(RuntimeError):
    """The server could not start (port taken, or it exited before it was ready)."""


# ------------------------------------------------------------------ runtime folder


def runtime_root() -> Path:
    """This user's folder for the launchers' runtime folders, mode 0700, created if missing."""
    base = os.environ.get(RUNTIME_ENV)
    root = (
        Path(base)
        if base
        else Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
        / f"workbench-server-{os.getuid()}"
    )
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ServerStartError(
            f"{root} must belong to this user with mode 0700 (it holds secrets); "
            f"remove it or set {RUNTIME_ENV}"
        )
    return root


def clean_stale_runtime_dirs(root: Path | None = None) -> list[Path]:
    """Remove runtime folders whose launcher is gone (a crash the watchdog did not survive)."""
    removed = []
    for folder in (root or runtime_root()).glob("launch-*"):
        pid = folder.name.removeprefix("launch-")
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def new_runtime_dir() -> Path:
    """A fresh private folder for this launch's secret files (stale ones are removed first)."""
    root = runtime_root()
    clean_stale_runtime_dirs(root)
    folder = root / f"launch-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700)
    return folder


def remove_runtime_dir(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ the process


def check_port_free(host: str, port: int) -> None:
    """Bind the port once, as the server will (SO_REUSEADDR, like uvicorn)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            why = "already in use" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
            raise ServerStartError(
                f"cannot listen on {host}:{port}: {why}; stop what runs there or pass --port"
            ) from None


def _die_with_parent() -> None:
    """In the server process before exec: SIGTERM when the launcher dies (Linux), and no terminal signals."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the launcher died before prctl took effect
            os._exit(1)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def start_watchdog(pgid: int, folder: Path) -> tuple[subprocess.Popen, int]:
    """The watchdog and the write end of its pipe (keep it open for as long as the server should live)."""
    read_end, write_end = os.pipe()  # neither end is inherited by the server (close_fds)
    # Its environment is the basics only: the launcher's holds the database URIs and more.
    watchdog = subprocess.Popen(
        [sys.executable, str(WATCHDOG), str(pgid), str(folder)],
        stdin=read_end,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        env=watchdog_env(),
    )
    os.close(read_end)
    return watchdog, write_end


def run(
    cmd: list[str],
    env: dict,
    url: str,
    folder: Path,
    on_ready: Callable[[], None],
    timeout: float = START_TIMEOUT,
) -> int:
    """Run the server in the foreground until it exits or this process is told to stop; its exit code.

    Raises:
        ServerStartError: It exited (any code) or did not answer before it was ready.
    """
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    watchdog, pipe = start_watchdog(proc.pid, folder)
    stopping = []

    def forward(signum, _frame):  # stop the whole server (it has worker processes)
        stopping.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if proc.poll() is not None:
                if stopping:
                    return 128 + stopping[0]
                raise ServerStartError(
                    f"mlflow server exited with code {proc.returncode} before it was ready "
                    "(its log is above)"
                )
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"mlflow server did not answer on {url}/health within {timeout:.0f} s"
                )
            time.sleep(0.3)
        on_ready()
        code = proc.wait()
        if stopping:
            return 0
        return code or 1  # it stopped on its own: never report that as success
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        os.close(pipe)  # the watchdog stops anything left of the group and removes the folder
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.wait(timeout=15)
