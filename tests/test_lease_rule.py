"""One lease rule for MLflow runs and queue trials: expiry, a process gone, takeover and release on a made-up clock."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from studies.ablation.cell_queue import LEASE_ATTR, expired
from tracking.record.lease import LEASE_ENV, lease_state, possible_writer
from tracking.record.lease_rule import HOST, Lease
from tracking.record.schema import RELEASED_TAG, TOKEN_TAG

T0 = 1_000_000.25  # the made-up clock's heartbeat time


def as_run(tags: dict):
    """What lease_state reads of an MLflow run: its tags and start time."""
    return SimpleNamespace(data=SimpleNamespace(tags=tags), info=SimpleNamespace(start_time=0))


def as_trial(lease: Lease):
    """What the queue reads of a RUNNING trial: its user attributes and start time."""
    return SimpleNamespace(user_attrs={LEASE_ATTR: lease.as_record()}, datetime_start=None)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "age, alive", [(0.0, True), (29.9, True), (30.0, True), (30.1, False), (600.0, False)]
)
def test_a_run_and_a_trial_with_one_lease_expire_at_the_same_moment(monkeypatch, age, alive):
    monkeypatch.setenv(LEASE_ENV, "30")
    lease = Lease("other-host", 4242, "tok", T0)
    run_state = lease_state(as_run(lease.as_tags()), now=T0 + age)
    trial_why = expired(as_trial(lease), grace=30, now=T0 + age)
    assert run_state.alive is alive and (trial_why is None) is alive, (run_state, trial_why)
    if not alive:
        said = f"lease of other-host/4242 expired: last heartbeat {age:.0f} s ago"
        assert run_state.why == f"{said} (lease 30 s)" and trial_why == f"{said} (grace 30 s)", (
            run_state.why,
            trial_why,
        )


def test_a_holder_whose_process_is_gone_on_this_host_is_dead_at_once_on_both_sides(monkeypatch):
    monkeypatch.setenv(LEASE_ENV, "30")
    lease = Lease(HOST, dead_pid(), "tok", T0)
    run_state = lease_state(as_run(lease.as_tags()), now=T0 + 1)
    trial_why = expired(as_trial(lease), grace=30, now=T0 + 1)
    assert (
        not run_state.alive
        and run_state.why
        == trial_why
        == f"process {lease.pid} on {HOST} is gone (last heartbeat 1 s ago)"
    ), (run_state, trial_why)
    # nobody can write under it any more: continue it in place
    assert lease.possible_writer() is None


def test_takeover_and_release():
    mine = Lease.mine(now=T0)
    assert (
        mine.is_mine()
        and mine.taken_over(mine.renewed(T0 + 5)) is None
        and mine.taken_over(None) is None
    )
    other = Lease("vm-2", 7, "theirs", T0 + 5)
    assert (
        mine.taken_over(other)
        == f"taken over by vm-2/7 (lease token theirs is not ours, {mine.token})"
    )
    # An MLflow run: its holder on another host may still write, unless it released the run itself.
    held = other.as_tags()
    assert possible_writer(as_run(held)) == "process 7 on vm-2 cannot be seen from here"
    assert possible_writer(as_run({**held, RELEASED_TAG: held[TOKEN_TAG]})) is None
    assert possible_writer(as_run({**held, RELEASED_TAG: "an older holder's"})) is not None


def test_both_stored_forms_hold_the_same_lease():
    lease = Lease("h", 12, "0123456789abcdef", T0)
    assert (
        Lease.from_tags(lease.as_tags()) == lease and Lease.from_record(lease.as_record()) == lease
    )
    assert Lease.from_tags({}) is None and Lease.from_record(None) is None
