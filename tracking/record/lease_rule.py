"""The lease rule, once, for MLflow runs and queue trials alike: who holds a thing, whether they live.

A lease is (host, pid, token, heartbeat time). Its holder renews the heartbeat; it is
**expired** once no heartbeat came for ``expiry`` seconds, or at once when its process is
gone on this very host; a **takeover** writes another token (the old holder finds a token
not its own at its next check and stops: ``taken_over``); a **release** is the holder's
own end (it will not write again). Where a lease is stored is its side's business: the
``lease.*`` tags of an MLflow run (``from_tags``, ``as_tags``; ``tracking.record.lease``)
or the ``lease`` user attribute of a queue trial (``from_record``, ``as_record``;
``studies.ablation.cell_queue``). Nothing here talks to a store, and every judgement takes
``now``, so the rule is tested on a made-up clock.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, replace

from tracking.record.schema import HEARTBEAT_TAG, HOST_TAG, PID_TAG, TOKEN_TAG

HOST = socket.gethostname()


def new_token() -> str:
    return uuid.uuid4().hex[:16]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


@dataclass(frozen=True)
class LeaseState:
    alive: bool
    why: str  # "running on host/pid (heartbeat 3 s ago)" or why it is dead
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    token: str
    heartbeat: float

    @classmethod
    def mine(cls, token: str | None = None, now: float | None = None) -> "Lease":
        """A lease of this process (a new token unless given), with its heartbeat now."""
        return cls(HOST, os.getpid(), token or new_token(), time.time() if now is None else now)

    def renewed(self, now: float | None = None) -> "Lease":
        return replace(self, heartbeat=time.time() if now is None else now)

    def is_mine(self) -> bool:
        return self.host == HOST and self.pid == os.getpid()

    def state(self, expiry: float, now: float | None = None, limit: str = "lease") -> LeaseState:
        """Alive or not, with why: gone on this host, no heartbeat for ``expiry`` s (``limit`` names it), or alive."""
        now = time.time() if now is None else now
        age = now - self.heartbeat
        if self.host == HOST and not pid_alive(self.pid):
            return LeaseState(
                False,
                f"process {self.pid} on {self.host} is gone (last heartbeat {age:.0f} s ago)",
                self.host,
                self.pid,
            )
        if age > expiry:
            return LeaseState(
                False,
                f"lease of {self.host}/{self.pid} expired: last heartbeat {age:.0f} s ago "
                f"({limit} {expiry:g} s)",
                self.host,
                self.pid,
            )
        return LeaseState(
            True,
            f"running on {self.host}/{self.pid} (heartbeat {age:.0f} s ago)",
            self.host,
            self.pid,
        )

    def possible_writer(self) -> str | None:
        """Who might still write under this lease, or None when nobody can: it is this process, or
        its process is gone on this very host. A live process here (paused, stalled) or any process
        on another host may wake up and write once more after its last check."""
        if self.is_mine():
            return None
        if self.host == HOST:
            return (
                f"process {self.pid} on this host is still alive" if pid_alive(self.pid) else None
            )
        return f"process {self.pid} on {self.host} cannot be seen from here"

    def taken_over(self, found: "Lease | None") -> str | None:
        """None while ``found`` (the lease read from the store now) is still this one; else who holds it."""
        if found is None or found.token == self.token:
            return None
        return f"taken over by {found.host}/{found.pid} (lease token {found.token} is not ours, {self.token})"

    # --- the two stored forms

    def as_tags(self) -> dict[str, str]:
        return {
            HOST_TAG: self.host,
            PID_TAG: str(self.pid),
            TOKEN_TAG: self.token,
            HEARTBEAT_TAG: f"{self.heartbeat:.3f}",
        }

    @classmethod
    def from_tags(cls, tags: dict) -> "Lease | None":
        """The lease in a run's tags; None for a run that never had one."""
        if HEARTBEAT_TAG not in tags:
            return None
        return cls(
            tags.get(HOST_TAG, "?"),
            int(tags.get(PID_TAG, "0") or 0),
            tags.get(TOKEN_TAG, ""),
            float(tags[HEARTBEAT_TAG]),
        )

    def as_record(self) -> dict:
        return {
            "host": self.host,
            "pid": self.pid,
            "token": self.token,
            "heartbeat": self.heartbeat,
        }

    @classmethod
    def from_record(cls, record: dict | None) -> "Lease | None":
        if not record:
            return None
        return cls(
            str(record["host"]),
            int(record["pid"]),
            str(record.get("token", "")),
            float(record["heartbeat"]),
        )
