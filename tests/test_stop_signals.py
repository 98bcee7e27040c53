"""Ctrl-C and SIGTERM are raised between database calls, never inside one.

An exception raised inside a SQLAlchemy call can leave its transaction open on a connection
nobody closes; a SQLite store then refuses every later write for 20 s and fails with
"database is locked" (seen in CI's SIGTERM test: the parent's end counts were lost).
"""

from __future__ import annotations

import signal
import sys

import pytest
import sqlalchemy as sa

from studies import ablate
from studies.ablate import Terminated, in_database_call, sigterm_raises


def frame_inside_a_database_call():
    engine = sa.create_engine("sqlite://")
    seen = []
    sa.event.listen(engine, "before_cursor_execute", lambda *a, **k: seen.append(sys._getframe()))
    with engine.connect() as conn:
        conn.execute(sa.text("select 1"))
    return seen[0]


@pytest.fixture
def sigint_at_its_default():
    """As in a terminal: a test run started in the background (CI under nohup) inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_stop_inside_a_database_call_is_sent_again_and_raised_outside(monkeypatch, sigint_at_its_default):
    timers = []

    class Timer:
        def __init__(self, delay, fn, args):
            timers.append((delay, fn, args))

        def start(self):
            pass

    monkeypatch.setattr(ablate.threading, "Timer", Timer)
    inside, outside = frame_inside_a_database_call(), sys._getframe()
    assert in_database_call(inside) and not in_database_call(outside)
    with sigterm_raises():
        handler = signal.getsignal(signal.SIGTERM)
        assert handler(signal.SIGTERM, inside) is None, "raised inside a database call"
        assert len(timers) == 1 and timers[0][2][1] == signal.SIGTERM and timers[0][0] <= 0.1
        with pytest.raises(Terminated, match="SIGTERM"):
            handler(signal.SIGTERM, outside)
        int_handler = signal.getsignal(signal.SIGINT)
        assert int_handler(signal.SIGINT, inside) is None and len(timers) == 2
        with pytest.raises(KeyboardInterrupt):
            int_handler(signal.SIGINT, outside)
        for _ in range(ablate.MAX_DEFERRALS - 1):  # a call that never returns does not hold a stop forever
            handler(signal.SIGTERM, inside)
        with pytest.raises(Terminated):
            handler(signal.SIGTERM, inside)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored(monkeypatch):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a process started in the background
    try:
        with sigterm_raises():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
