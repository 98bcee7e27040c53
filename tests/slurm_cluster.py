"""A single-node SLURM cluster on 127.0.0.1 for the slow tier: munged, slurmctld and slurmd from Debian's packages.

Everything lives in a temp folder (munge key and socket, slurm.conf, state, spool, logs) and
the daemons are stopped afterwards. Clients find the cluster through ``SLURM_CONF``. The
daemons run as root (SlurmUser=root), as they must to start jobs; without root, or without
the packages (``apt-get install slurm-wlm munge``), the test skips with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from servers import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")

CONF = """\
ClusterName=workbench-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={root}/munge.sock,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# No cgroups: processes tracked by parent pid, no CPU binding (a container has neither)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def missing_reason() -> str | None:
    """Why no cluster can be started here, or None."""
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return f"SLURM or munge not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs; this test runs as another user"
    return None


def _run(cmd: list[str], env: dict | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    if done.returncode:
        raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {done.stdout}{done.stderr}")


def _stop(pid_file: Path) -> None:
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)


@contextlib.contextmanager
def slurm_cluster():
    """Yield the environment (``SLURM_CONF``) of a one-node cluster with ``os.cpu_count()`` CPUs."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    # A short path: a UNIX socket's path has at most 107 characters.
    root = Path(tempfile.mkdtemp(prefix="wb-slurm-"))
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        CONF.format(
            host=host,
            root=root,
            ctld_port=free_port(),
            slurmd_port=free_port(),
            cpus=os.cpu_count() or 1,
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        _run(["mungekey", "--create", f"--keyfile={root}/munge.key"])
        # --force: the temp folder is under the world-writable /tmp, which munged refuses otherwise
        _run(
            [
                "munged",
                "--force",
                f"--socket={root}/munge.sock",
                f"--key-file={root}/munge.key",
                f"--log-file={root}/log/munged.log",
                f"--pid-file={root}/munged.pid",
                f"--seed-file={root}/munged.seed",
            ]
        )
        _run(["slurmctld", "-f", str(conf), "-i"], env)
        _run(["slurmd", "-f", str(conf)], env)
        _wait_idle(env, root)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        _stop(root / "slurmd.pid")
        _stop(root / "slurmctld.pid")
        _stop(root / "munged.pid")
        time.sleep(1)
        shutil.rmtree(root, ignore_errors=True)


def _wait_idle(env: dict, root: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        state = done.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    logs = "".join(
        f"\n--- {p.name} ---\n{p.read_text()[-2000:]}" for p in sorted((root / "log").glob("*.log"))
    )
    raise RuntimeError(f"the SLURM node did not become idle (sinfo: {state!r}){logs}")


def squeue(env: dict, job: str) -> list[str]:
    """``<array task> <state>`` of each task of array job ``job`` still pending or running."""
    done = subprocess.run(
        ["squeue", "-h", "-r", "-o", "%i %T"], env=env, capture_output=True, text=True, timeout=60
    )
    return [line for line in done.stdout.splitlines() if line.startswith(f"{job}_")]
