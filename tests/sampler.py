"""A process-list sampler: what ``ps -ef`` would show every user while a command runs.

Reads ``/proc/<pid>/cmdline`` of every process every ``interval`` seconds in a background
thread (Linux) and keeps each command line that holds one of the given secrets.
"""

from __future__ import annotations

import glob
import threading


class ArgvSampler:
    """``with ArgvSampler(secret, ...) as s: <run something>``; then ``s.check(seen="ablate")``."""

    def __init__(self, *secrets: str, interval: float = 0.2) -> None:
        self.secrets, self.interval = [s.encode() for s in secrets], interval
        self.leaks: list[str] = []
        self.samples = 0
        self.commands: set[str] = set()  # every command line seen, for check(seen=...)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for path in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                with open(path, "rb") as f:
                    argv = f.read()
            except OSError:  # the process ended meanwhile
                continue
            if not argv:
                continue
            line = argv.replace(b"\0", b" ").decode(errors="replace").strip()
            self.commands.add(line)
            if any(secret in argv for secret in self.secrets):
                self.leaks.append(f"{path}: {line}")
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "ArgvSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def check(self, seen: str) -> None:
        """No secret in any argv, and the sampler did see a process whose command line holds ``seen``
        (a sampler that saw nothing proves nothing)."""
        assert not self.leaks, (
            f"a password in a process's argv ({len(self.leaks)} samples): {self.leaks[:3]}"
        )
        assert any(seen in line and "studies.cli" in line for line in self.commands), (
            f"the sampler ({self.samples} rounds) never saw a {seen!r} process"
        )
        assert self.samples >= 2, self.samples
