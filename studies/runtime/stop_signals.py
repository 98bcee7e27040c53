"""Ctrl-C and SIGTERM in a study: raised where they cannot break a write, and never forgotten.

A stop raised inside a database call can leave its transaction open on a connection nobody
closes: a SQLite store then refuses every later write ("database is locked" after 20 s), the
run's end and the parent's counts among them (seen once in CI's SIGTERM test). A stop raised
inside ``torch.save`` is turned by torch's zip writer into ``RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos ...``: in CI a worker of ``ablate --jobs`` then
recorded its cell FAILED, took the next cell and trained on after Ctrl-C. So the handler sends
the signal again shortly while either is under way, and remembers the stop: an error that
surfaces while a stop is pending is reported as that stop (``pending_stop``).

A stop can also be swallowed whole: raised inside a ``__del__``, a weakref or garbage-collector
callback, Python prints "Exception ignored in ..." and goes on. In CI a Ctrl-C landed in
importlib's module-lock callback and one job of ``ablate --jobs`` trained its cell to the end.
Such a stop is sent again (``sys.unraisablehook``), so it is raised in the code that was running.

A queue worker (``sigterm_raises(preemptible=True)``) takes SIGTERM and SIGUSR1 as a preemption
(``Preempted``): while a cell trains (``stops_at_step_boundaries``) the handler only remembers it and
the training loop raises it before its next step, so the step under way finishes and can be
checkpointed (``studies.ablation.preemption``; docs/remote.md, "Preemption").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that every run records how the execution ended (KILLED, as Ctrl-C)."""


class Preempted(Terminated):
    """SIGTERM or SIGUSR1 (SLURM's warning signal) to a queue worker: a scheduler takes the machine back.

    Inside a cell's training (``stops_at_step_boundaries``) it is not raised by the handler but at
    the next step boundary, so the current step finishes and a checkpoint of it can be written
    (``studies.ablation.preemption``); elsewhere it is raised like ``Terminated``.
    """


# Frames a stop must not interrupt: a database call (SQLAlchemy, sqlite3) and an atomic file
# write (checkpoints, caches: workbench/atomic.py holds the temp file until it is renamed).
DB_CALL_MARKERS = (f"{os.sep}sqlalchemy{os.sep}", f"{os.sep}sqlite3{os.sep}")
WRITE_MARKERS = (f"{os.sep}workbench{os.sep}atomic.py",)
DEFER_SECONDS, MAX_DEFERRALS = 0.05, 200  # at most 10 s: a stop is never lost to a stuck call
RESEND_SECONDS = 0.01  # a swallowed stop comes back this soon, in the code that was running

_pending: list[BaseException] = []  # the stop this process was asked for, once asked
_signums: list[int] = []  # the signal that asked for it, to send again if Python swallows the stop
_step_boundaries: list[bool] = []  # non-empty while a preemption waits for the next training step


def _inside(frame, markers: tuple[str, ...]) -> bool:
    while frame is not None:
        if any(marker in frame.f_code.co_filename for marker in markers):
            return True
        frame = frame.f_back
    return False


def in_database_call(frame) -> bool:
    return _inside(frame, DB_CALL_MARKERS)


def in_protected_call(frame) -> bool:
    """Inside a database call or an atomic write: a stop raised here would break it."""
    return _inside(frame, DB_CALL_MARKERS + WRITE_MARKERS)


def pending_stop() -> BaseException | None:
    """The Ctrl-C or SIGTERM received since ``sigterm_raises`` began, if any."""
    return _pending[0] if _pending else None


def as_stop(err: BaseException) -> BaseException:
    """``err`` itself, or the pending stop when ``err`` is another error raised after it.

    The stop may have been turned into something else on its way up (torch's zip writer makes a
    ``RuntimeError`` of it); what ended the work is still the user's stop, not a failure.
    """
    stop = pending_stop()
    if stop is None or isinstance(err, KeyboardInterrupt):
        return err
    replaced = type(stop)(*stop.args)
    replaced.__cause__ = err
    return replaced


def stop_reason(stop: BaseException, err: BaseException) -> str:
    """What ended the work, for a run's ``end_reason``: the stop, and what it came out as if it changed."""
    reason = f"{type(stop).__name__}: {stop}"
    return reason if stop is err else f"{reason} (came out as {type(err).__name__}: {err})"


def _stop_between_writes(make_error):
    """A signal handler raising ``make_error(signum)``, but never inside a protected call: it is sent again shortly."""
    deferred = [0]

    def handler(signum, frame):
        if not _pending:
            _pending.append(make_error(signum))
            _signums.append(signum)
        if _step_boundaries and isinstance(_pending[0], Preempted):
            return  # raised by the training loop's next step check (``preemption_requested``)
        if in_protected_call(frame) and deferred[0] < MAX_DEFERRALS:
            deferred[0] += 1
            threading.Timer(DEFER_SECONDS, os.kill, (os.getpid(), signum)).start()
            return
        raise make_error(signum)

    return handler


def _resend_swallowed_stops(previous_hook):
    """An unraisable-exception hook: a pending stop Python could not raise is sent again, not printed."""

    def hook(unraisable):
        if _pending and isinstance(unraisable.exc_value, KeyboardInterrupt):
            # From another thread: sent from here, the handler would run (and be swallowed) in this hook.
            threading.Timer(RESEND_SECONDS, os.kill, (os.getpid(), _signums[0])).start()
            return
        previous_hook(unraisable)

    return hook


def preemption_requested() -> Preempted | None:
    """The pending preemption (``Preempted``), if a scheduler asked for one; a Ctrl-C is not one."""
    stop = pending_stop()
    return stop if isinstance(stop, Preempted) else None


@contextlib.contextmanager
def stops_at_step_boundaries():
    """Within: a preemption is not raised by the signal handler but left for the training loop's
    next step check (``preemption_requested``), so the step under way finishes. One still pending
    when the block ends without an error (training ended first) is raised there."""
    _step_boundaries.append(True)
    try:
        yield
    finally:
        _step_boundaries.pop()
    stop = preemption_requested()
    if stop is not None:
        raise stop


def _stop_for(preemptible: bool):
    """What a SIGTERM (or SIGUSR1) becomes: ``Preempted`` in a queue worker, else ``Terminated``."""
    kind = Preempted if preemptible else Terminated
    return lambda signum: kind(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_raises(preemptible: bool = False):
    """Turn SIGTERM into ``Terminated`` for the duration (a batch scheduler's stop is not a crash).

    SIGTERM and Ctrl-C are raised between database calls and atomic writes, never inside one. A
    SIGINT this process ignores (started in the background) stays ignored. ``preemptible`` (a queue
    worker): SIGTERM and SIGUSR1 become ``Preempted`` (docs/remote.md, "Preemption").
    """
    try:
        previous = signal.signal(signal.SIGTERM, _stop_between_writes(_stop_for(preemptible)))
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    previous_usr1 = (
        signal.signal(signal.SIGUSR1, _stop_between_writes(_stop_for(True)))
        if preemptible
        else None
    )
    _pending.clear()
    _signums.clear()
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop_between_writes(lambda signum: KeyboardInterrupt()))
    previous_hook, sys.unraisablehook = (
        sys.unraisablehook,
        _resend_swallowed_stops(sys.unraisablehook),
    )
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_usr1 is not None:
            signal.signal(signal.SIGUSR1, previous_usr1)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_int)
        sys.unraisablehook = previous_hook
        _pending.clear()
        _signums.clear()
