"""Leases on MLflow runs: who is running a run, whether they are still alive, and fencing.

Every RUNNING run this project makes carries a lease in its tags: host, pid, a token for
this execution, and a heartbeat time that a background thread renews. A run whose lease
expired (no heartbeat for ``lease_seconds()``, or its process is gone on this very host)
belongs to a dead execution: ``reap_expired`` marks it KILLED with a reason tag instead of
leaving it RUNNING forever.

The token fences a cell: when another execution takes a cell over, it writes its own
token; the old holder sees a token that is not its own at its next step and stops
without logging anything more (``LeaseLost``). MLflow has no conditional write, so a
holder paused between its check and its upload could still land one late point: a run
whose holder may still be alive (``possible_writer``) is therefore never continued; the
cell continues in a fresh run and the old one is closed as superseded.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from mlflow.entities import Run, RunTag
from mlflow.tracking import MlflowClient

from tracking.record.lease_rule import HOST, Lease, LeaseState, new_token, pid_alive
from tracking.record.schema import (
    CONTINUES_TAG,
    EXEC_PREFIX,
    HEARTBEAT_TAG,
    HOST_TAG,
    PID_TAG,
    REASON_TAG,
    RELEASED_TAG,
    RUN_NAME,
    RUNNING,
    SUPERSEDED_TAG,
    TOKEN_TAG,
    status_is,
)
from tracking.store.health import known_down
from tracking.store.uris import is_remote

# The names the study runtime uses, the tag names among them (they live in tracking.record.schema).
__all__ = [
    "CONTINUES_TAG",
    "EXEC_PREFIX",
    "HEARTBEATS",
    "HEARTBEAT_TAG",
    "HOST",
    "HOST_TAG",
    "Heartbeats",
    "LeaseLost",
    "LeaseState",
    "PID_TAG",
    "REASON_TAG",
    "RELEASED_TAG",
    "SUPERSEDED_TAG",
    "TOKEN_TAG",
    "dead_executions",
    "execution_states",
    "execution_tag",
    "execution_value",
    "heartbeat_seconds",
    "is_mine",
    "last_sign_of_life",
    "lease_seconds",
    "lease_state",
    "lease_tags",
    "new_token",
    "pid_alive",
    "possible_writer",
    "reap_expired",
]

LEASE_ENV, HEARTBEAT_ENV = "WORKBENCH_LEASE_SECONDS", "WORKBENCH_HEARTBEAT_SECONDS"
DEFAULT_LEASE_SECONDS = 120.0
RELEASE_WAIT_SECONDS = 15.0  # a beat on a reachable store takes well under a second


def lease_seconds() -> float:
    """How long a run may go without a heartbeat before it counts as dead."""
    return float(os.environ.get(LEASE_ENV) or DEFAULT_LEASE_SECONDS)


def heartbeat_seconds() -> float:
    return float(os.environ.get(HEARTBEAT_ENV) or max(0.5, lease_seconds() / 4))


def lease_tags(token: str) -> dict[str, str]:
    """The ``lease.*`` tags of a run this process holds from now on, under ``token``."""
    return Lease.mine(token).as_tags()


def execution_tag(token: str) -> str:
    return EXEC_PREFIX + token


def execution_value(now: float | None = None) -> str:
    return f"{HOST} {os.getpid()} {(now or time.time()):.3f}"


def _judge(host: str, pid: int, heartbeat: float, now: float) -> LeaseState:
    return Lease(host, pid, "", heartbeat).state(lease_seconds(), now)


def _executions(tags: dict) -> dict[str, tuple[str, int, float]]:
    """Execution tag -> (host, pid, heartbeat time) of a shared run."""
    found = {}
    for key, value in tags.items():
        if key.startswith(EXEC_PREFIX):
            try:
                host, pid, heartbeat = value.rsplit(" ", 2)
                found[key] = (host, int(pid), float(heartbeat))
            except ValueError:  # not ours to judge: ignore it
                continue
    return found


def execution_states(run: Run, now: float | None = None) -> dict[str, tuple[LeaseState, float]]:
    """Execution tag -> (whether that execution is alive, its last heartbeat time) on a shared run."""
    now = now or time.time()
    return {key: (_judge(*e, now), e[2]) for key, e in _executions(run.data.tags).items()}


def dead_executions(run: Run, now: float | None = None) -> list[str]:
    """The execution tags of a shared run whose executions are gone (killed ones never removed theirs)."""
    return [key for key, (state, _) in execution_states(run, now).items() if not state.alive]


def lease_state(run: Run, now: float | None = None) -> LeaseState:
    """Whether the execution holding a RUNNING run is alive, judged from its lease tags.

    A shared run (execution tags) is alive while any of its executions is.
    """
    tags, now = run.data.tags, now or time.time()
    executions = _executions(tags).values()
    if executions:
        states = [_judge(*e, now) for e in sorted(executions, key=lambda e: -e[2])]
        alive = [s for s in states if s.alive]
        if alive:
            more = f" and {len(alive) - 1} more execution(s)" if len(alive) > 1 else ""
            return LeaseState(True, alive[0].why + more, alive[0].host, alive[0].pid)
        return (
            states[0]
            if len(states) == 1
            else LeaseState(
                False,
                f"all {len(states)} executions are gone; the last: {states[0].why}",
                states[0].host,
                states[0].pid,
            )
        )
    lease = Lease.from_tags(tags)
    if lease is None:
        # A run from before leases existed: judge by its age alone.
        age = now - (run.info.start_time or 0) / 1000
        return LeaseState(age < lease_seconds(), f"no lease; started {age:.0f} s ago")
    return lease.state(lease_seconds(), now)


def is_mine(run: Run) -> bool:
    return run.data.tags.get(HOST_TAG) == HOST and run.data.tags.get(PID_TAG) == str(os.getpid())


def possible_writer(run: Run) -> str | None:
    """Who might still write to this run, or None when nobody can any more.

    Nobody can when the run never had a lease, its holder ended it itself (``RELEASED_TAG``
    carries the holder's token), the holder is this process, or the holder's process is
    gone on this very host. Otherwise (another host, or a live process here: paused, or
    stalled) its holder may wake up and upload one more point after passing its last
    check, and nothing in MLflow can refuse that write.
    """
    tags = run.data.tags
    lease = Lease.from_tags(tags)
    if lease is None:
        return None
    if tags.get(RELEASED_TAG) and tags.get(RELEASED_TAG) == tags.get(TOKEN_TAG):
        return None
    return lease.possible_writer()


def last_sign_of_life(run: Run) -> int | None:
    """A dead run's end (ms): its last heartbeat, any execution's; None (now) for a run without a lease.

    Not the time of the execution that finds it dead: a study killed at 10:05 and reaped by a
    rerun at 14:00 ended at 10:05 (docs/study-record.md: the end is the study's last work).
    """
    beats = [beat for *_, beat in _executions(run.data.tags).values()]
    with contextlib.suppress(KeyError, ValueError):
        beats.append(float(run.data.tags[HEARTBEAT_TAG]))
    if not beats:
        return None
    return max(round(max(beats) * 1000), run.info.start_time or 0)


def reap_expired(
    client: MlflowClient, experiment_id: str, filter_string: str = "", log=None
) -> list[tuple[str, str]]:
    """Mark every RUNNING run (matching ``filter_string``) whose lease expired as KILLED, with the reason.

    Returns ``[(run_id, reason)]``. Runs of this process are never touched.
    """
    where = status_is(RUNNING) + (f" and {filter_string}" if filter_string else "")
    reaped = []
    for run in client.search_runs([experiment_id], filter_string=where, max_results=5000):
        if is_mine(run) or lease_state(run).alive:
            continue
        # The search may be seconds old on a busy machine: a holder that ended its run and
        # exited meanwhile would look dead. Judge the run as it is now, right before writing.
        with contextlib.suppress(Exception):
            run = client.get_run(run.info.run_id)
        state = lease_state(run)
        if run.info.status != "RUNNING" or state.alive:
            continue
        try:
            # log_batch: two reapers may write the new tag at once; MLflow retries that insert there.
            client.log_batch(run.info.run_id, tags=[RunTag(REASON_TAG, state.why[:500])])
            client.set_terminated(run.info.run_id, "KILLED", end_time=last_sign_of_life(run))
        except Exception:
            with contextlib.suppress(Exception):
                if client.get_run(run.info.run_id).info.status != "RUNNING":
                    continue  # another execution reaped (or resumed) it meanwhile
            raise
        reaped.append((run.info.run_id, state.why))
        if log:
            log(
                f"marked run {run.info.run_id} ({run.data.tags.get(RUN_NAME, '?')}) KILLED: {state.why}"
            )
    return reaped


class LeaseLost(Exception):
    """Another execution took this run over: stop without logging anything more to it."""


class Heartbeats:
    """One daemon thread per process renewing the leases of the runs it holds.

    For each held run it first reads the token: when it is not ours any more, the run was
    taken over, so the heartbeat stops and ``check`` raises ``LeaseLost`` at the next step.
    A tracking store that cannot be reached is skipped quietly (the sink goes offline).
    """

    def __init__(self) -> None:
        self._held: dict[
            str, tuple[str, str, str | None]
        ] = {}  # run id -> (tracking uri, token, execution tag)
        self._lost: dict[str, str] = {}
        self._lock = threading.Lock()
        # Run id -> lock held while a beat reads and writes that run's tags: ``release`` waits
        # for a beat of the run under way, so no renewal lands after the holder closed it.
        self._writers: dict[str, threading.Lock] = {}
        self._thread: threading.Thread | None = None
        self._extra: dict[str, object] = {}  # name -> callable renewing another lease (a queue's)
        # Set by ``hold``: the thread renews at once and then at the current interval, not
        # after a sleep begun with an older (longer) one.
        self._wake = threading.Event()

    def also(self, name: str, beat) -> None:
        """Also call ``beat()`` at every heartbeat (``None`` stops it); errors are ignored."""
        with self._lock:
            if beat is None:
                self._extra.pop(name, None)
            else:
                self._extra[name] = beat
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="workbench-lease", daemon=True
                )
                self._thread.start()

    def hold(self, run_id: str, uri: str, token: str, execution: str | None = None) -> None:
        """Renew ``run_id``'s lease; ``execution``: this execution's own tag on a shared run."""
        with self._lock:
            self._held[run_id] = (uri, token, execution)
            self._lost.pop(run_id, None)
        self._wake.set()
        self._ensure_thread()

    def release(self, run_id: str) -> None:
        """Stop renewing ``run_id``; returns once no beat of it is under way any more.

        The wait is bounded: a beat stuck on an unreachable server must not hold up the end.
        """
        with self._lock:
            held = self._held.pop(run_id, None)
            writer = self._writers.get(run_id)
        if held is None or writer is None or (is_remote(held[0]) and known_down(held[0])):
            return  # no beat of it yet, or one stuck on a server that is away: it writes nothing
        if writer.acquire(timeout=RELEASE_WAIT_SECONDS):
            with self._lock:
                self._writers.pop(run_id, None)
            writer.release()

    def check(self, run_id: str, verify: bool = False) -> None:
        """Raise ``LeaseLost`` when the run was taken over; ``verify`` reads the token from the store now."""
        if verify:
            self._beat(run_id, renew=False)
        if run_id in self._lost:
            raise LeaseLost(self._lost[run_id])

    def _loop(self) -> None:
        while True:
            try:
                self._wake.wait(heartbeat_seconds())
            except ValueError:  # a malformed interval setting: the default, not a dead thread
                self._wake.wait(DEFAULT_LEASE_SECONDS / 4)
            self._wake.clear()
            with self._lock:
                held, extra = list(self._held), list(self._extra.values())
            # Nothing may end this thread: every lease of the process would expire with it.
            for beat in [*extra, *(lambda r=r: self._beat(r) for r in held)]:
                try:
                    beat()
                except Exception:  # noqa: BLE001 - a missed beat only shortens the lease
                    pass

    def _beat(self, run_id: str, renew: bool = True) -> None:
        with self._lock:
            if run_id not in self._held:
                return
            writer = self._writers.setdefault(run_id, threading.Lock())
        with writer:
            self._beat_held(run_id, renew)

    def _beat_held(self, run_id: str, renew: bool) -> None:
        with self._lock:
            if run_id not in self._held:
                return
            uri, token, execution = self._held[run_id]
        client = MlflowClient(uri)
        try:
            tags = client.get_run(run_id).data.tags
            taken = Lease(HOST, os.getpid(), token, 0.0).taken_over(Lease.from_tags(tags))
            if taken:
                if tags.get(SUPERSEDED_TAG):
                    why = f"run {run_id} was taken over and the cell continues in run {tags[SUPERSEDED_TAG]}"
                else:
                    why = f"run {run_id} was {taken}"
                with self._lock:
                    self._lost[run_id] = why
                    self._held.pop(run_id, None)
                return
            if renew and execution:
                now = time.time()
                client.log_batch(
                    run_id,
                    tags=[
                        RunTag(HEARTBEAT_TAG, f"{now:.3f}"),
                        RunTag(execution, execution_value(now)),
                    ],
                )
            elif renew:
                client.set_tag(run_id, HEARTBEAT_TAG, f"{time.time():.3f}")
        except Exception:  # an unreachable store: the run's sink handles the outage
            return


HEARTBEATS = Heartbeats()
