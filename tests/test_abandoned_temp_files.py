"""A cache write killed with SIGKILL leaves its temp file; the next start removes it, and only it.

``atomic_write`` holds a lock on its temp file while it lives; a temp file nobody holds and
older than ``ABANDONED_AFTER_SECONDS`` is a leftover. A write still under way (its writer
alive, in this process or another) is never touched.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from studies.runtime.preflight import remove_abandoned_cache_files
from workbench.atomic import ABANDONED_AFTER_SECONDS, remove_abandoned_temp_files

ROOT = Path(__file__).resolve().parents[1]

SLOW_WRITER = """
import sys, time
from workbench.atomic import atomic_write
def write(f):
    f.write(b"x" * 4096); f.flush()
    print("writing", flush=True)
    time.sleep(600)
atomic_write(sys.argv[1], write)
"""


def start_writer(target: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(target)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "writing"
    return proc


def age(path: Path) -> None:
    old = time.time() - ABANDONED_AFTER_SECONDS - 60
    os.utime(path, (old, old))


def test_a_killed_cache_write_is_removed_at_the_next_start_and_a_live_one_is_kept(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    decoded = tmp_path / "cache" / "decoded"
    killed, alive = (
        start_writer(decoded / "fashion_mnist-abc.npz"),
        start_writer(decoded / "cifar10-def.npz"),
    )
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        temps = sorted(decoded.glob(".*.tmp"))
        assert len(temps) == 2, temps
        for tmp in temps:
            age(tmp)  # both old enough; only the lock tells them apart
        leftover = next(t for t in temps if t.name.startswith(".fashion_mnist"))
        remove_abandoned_cache_files()
        assert sorted(decoded.glob(".*.tmp")) == [t for t in temps if t != leftover]
        assert f"removed {leftover}" in capsys.readouterr().err
        assert alive.poll() is None, "the live writer was disturbed"
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(timeout=30)


def test_a_young_or_held_temp_file_is_kept(tmp_path):
    young, held, abandoned = (tmp_path / f".f{i}.npz.x.tmp" for i in range(3))
    for path in (young, held, abandoned):
        path.write_bytes(b"x")
    for path in (held, abandoned):
        age(path)
    fd = os.open(held, os.O_RDONLY)
    try:
        # another open file description: as a writer in this process would hold it
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_abandoned_temp_files(tmp_path) == [abandoned]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, held.name])
    assert remove_abandoned_temp_files(tmp_path / "missing") == []
