"""Ctrl-C and SIGTERM are raised between database calls, never inside one.

An exception raised inside a SQLAlchemy call can leave its transaction open on a connection
nobody closes; a SQLite store then refuses every later write for 20 s and fails with
"database is locked" (seen in CI's SIGTERM test: the parent's end counts were lost).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time

import pytest
import sqlalchemy as sa
import torch
from mlflow.tracking import MlflowClient

from studies.ablation.train import train_one
from studies.runtime import stop_signals
from studies.runtime.stop_signals import Terminated, in_database_call, sigterm_raises
from synthetic import synthetic_data, tiny_config
from workbench.train.loop import TrainingObserver


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


def test_a_stop_inside_a_database_call_is_sent_again_and_raised_outside(
    monkeypatch, sigint_at_its_default
):
    timers = []

    class Timer:
        def __init__(self, delay, fn, args):
            timers.append((delay, fn, args))

        def start(self):
            pass

    monkeypatch.setattr(stop_signals.threading, "Timer", Timer)
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
        for _ in range(
            stop_signals.MAX_DEFERRALS - 1
        ):  # a call that never returns does not hold a stop forever
            handler(signal.SIGTERM, inside)
        with pytest.raises(Terminated):
            handler(signal.SIGTERM, inside)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored(monkeypatch):
    # as in a process started in the background
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sigterm_raises():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


class _InterruptedFile(io.BytesIO):
    """A file whose second write is hit by a real Ctrl-C (this process sends itself SIGINT)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data):
        self.writes += 1
        if self.writes == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(data)


def test_a_stop_during_an_atomic_write_is_raised_after_the_file_is_complete(
    tmp_path, sigint_at_its_default
):
    from workbench.atomic import atomic_write

    target = tmp_path / "checkpoint.pt"
    state = {"w": torch.arange(10_000, dtype=torch.float32)}
    with sigterm_raises():
        with pytest.raises(KeyboardInterrupt):
            atomic_write(target, lambda f: torch.save(state, _Forward(f)))
            time.sleep(2)  # the deferred signal comes back 50 ms after the write
    assert torch.equal(torch.load(target, weights_only=True)["w"], state["w"]), (
        "the checkpoint was cut"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"], "a temp file was left"


class _StoppedWhileCollected:
    """Its ``__del__`` is hit by a real Ctrl-C, as importlib's module-lock callback was in CI."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the handler runs here, inside __del__
            pass


def test_a_stop_python_swallows_in_a_callback_is_raised_again_in_the_running_code(
    sigint_at_its_default,
):
    """Python cannot raise from ``__del__`` or a weakref callback: it prints "Exception ignored in"
    and goes on. In CI one job of ``ablate --jobs`` then trained its cell to the end after Ctrl-C."""
    reached = []
    with sigterm_raises():
        with pytest.raises(KeyboardInterrupt):
            _StoppedWhileCollected()  # collected at once: __del__ runs here
            reached.append("after __del__")
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                pass
            reached.append("loop ended")  # the stop was lost
        assert stop_signals.pending_stop() is not None
    assert reached in ([], ["after __del__"]), reached
    assert sys.unraisablehook is not None and stop_signals.pending_stop() is None


class _Forward(io.RawIOBase):
    """Writes go to ``f``; the second one is hit by a real Ctrl-C."""

    def __init__(self, f) -> None:
        self.f, self.writes = f, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return self.f.write(data)


def test_a_stop_that_torch_save_turns_into_another_error_is_still_a_stop(
    mlflow_store, tmp_path, sigint_at_its_default
):
    """torch's zip writer makes ``RuntimeError: [enforce fail ...] unexpected pos`` of a Ctrl-C that
    lands inside ``torch.save``: CI's ``ablate --jobs`` worker then recorded its cell FAILED and
    trained the next cell after Ctrl-C. The run must end KILLED for the Ctrl-C, and the error go up
    as a KeyboardInterrupt."""

    class SaveOnEpoch(TrainingObserver):
        def on_epoch(self, metrics: dict) -> None:
            # not an atomic write: nothing defers it
            torch.save({"w": torch.zeros(1000)}, _InterruptedFile())

    data = synthetic_data(n_train=64, n_val=32, n_test=16)
    with sigterm_raises():
        with pytest.raises(KeyboardInterrupt) as raised:
            train_one(
                tiny_config(epochs=3),
                data,
                experiment="tiny",
                output_dir=tmp_path / "out",
                run_name="tiny",
                observer=SaveOnEpoch(),
                log=lambda line: None,
            )
    assert isinstance(raised.value.__cause__, RuntimeError) and "unexpected pos" in str(
        raised.value.__cause__
    )
    (run,) = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name("tiny").experiment_id]
    )
    assert run.info.status == "KILLED", run.info.status
    reason = run.data.tags["end_reason"]
    assert reason.startswith("KeyboardInterrupt") and "came out as RuntimeError" in reason, reason


@pytest.mark.parametrize("what", ["error", "ctrl-c", "ctrl-c come out as an error"])
def test_a_transfer_or_intervention_cell_ends_failed_for_an_error_and_killed_for_a_stop(
    mlflow_store, what, sigint_at_its_default
):
    """``end_after_error``, as the transfer and intervene cells call it from their ``except``."""
    from studies.runtime.cell_end import end_after_error
    from tracking.record.sink import RunSink

    sink = RunSink.create("cells", {"mlflow.runName": "cell"})
    with sigterm_raises():
        try:
            if what == "error":
                raise ValueError("bad input")
            if what == "ctrl-c":
                signal.getsignal(signal.SIGINT)(signal.SIGINT, sys._getframe())
            # the Ctrl-C lands in the zip writer
            torch.save({"w": torch.zeros(1000)}, _InterruptedFile())
        except BaseException as err:  # noqa: BLE001 - as the cells do
            if what == "error":
                assert end_after_error(sink, "token", err) == "ValueError: bad input"
            else:
                with pytest.raises(KeyboardInterrupt):
                    end_after_error(sink, "token", err)
    run = MlflowClient().get_run(sink.run_id)
    if what == "error":
        assert (
            run.info.status == "FAILED" and run.data.tags["failure"] == "ValueError: bad input"
        ), run.data.tags
    else:
        assert run.info.status == "KILLED", run.info.status
        assert run.data.tags["end_reason"].startswith("KeyboardInterrupt"), run.data.tags
        assert ("came out as RuntimeError" in run.data.tags["end_reason"]) == (what != "ctrl-c"), (
            run.data.tags
        )
