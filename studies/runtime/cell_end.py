"""How a study cell's run ends when its holder ends it: done, failed, or stopped by the user.

The one end of every leased run a study trains or evaluates: ``ablate``'s cells and ``train``'s and
a sweep's runs (``train_one``: ``hold_opened``, ``training_outcome``, ``ended``), ``transfer``'s,
``intervene``'s and ``attribute``'s. The rules: the
lease is released first (so the next execution may continue the run in place), an error ends it
FAILED with tag ``failure``, Ctrl-C or SIGTERM ends it KILLED with tag ``end_reason``, and a full or
read-only store stops the execution (``StoreUnwritable``): every later cell would fail the same way.
"""

from __future__ import annotations

import contextlib
import traceback

import click
from tqdm.auto import tqdm

from studies.runtime.outcome import CellOutcome, Status
from studies.runtime.stop_signals import as_stop, stop_reason
from tracking.record.cell_runs import KeyedRun, end_held_run, withdraw_candidate
from tracking.record.create_once import ClaimLost
from tracking.record.lease import HEARTBEATS, LeaseLost
from tracking.record.sink import RunSink
from tracking.store.store_errors import explain
from workbench.train.loop import NonFiniteLoss, StopTraining


class StoreUnwritable(click.ClickException):
    """The tracking store cannot take more writes (full, read-only): every later cell would fail the same way."""


REASON_CHARS = 500


def hold_opened(
    cell, opened: KeyedRun, log=tqdm.write, *, name: str | None = None
) -> CellOutcome | None:
    """The outcome of a cell whose run needs nothing from this execution, or None: this execution holds it.

    ``opened`` is the cell's run found or created by its key under this execution's lease
    (``tracking.record.cell_runs.open_leased_run``): FINISHED (skipped), BUSY (a live execution
    elsewhere holds it: not touched), or to work on (held from now on; an older holder is fenced off).
    ``name``: how the console names the run (default: the cell's key).
    """
    name = cell.key if name is None else name
    if opened.status == "FINISHED":
        return CellOutcome(
            cell,
            Status.SKIPPED,
            f"{name}: skipped (finished in run {opened.run_id})",
            opened.run_id,
            opened.metrics,
        )
    if opened.status == "BUSY":
        return CellOutcome(
            cell,
            Status.BUSY,
            f"{name}: not touched ({opened.why}, run {opened.run_id})",
            opened.run_id,
            opened.metrics,
        )
    if opened.continues:
        log(
            f"{name}: continuing in a new run {opened.sink.run_id}: the holder of run {opened.continues} "
            "may still write to that one"
        )
    return None


def outcome_of_error(
    cell, sink: RunSink, token: str, err: BaseException, *, name: str | None = None
) -> CellOutcome:
    """A held cell's outcome for ``err``, from the ``except`` that caught it (``end_after_error``).

    A lost lease: another execution holds the run now, so not one more write to it (LOST). Any other
    error ends the run FAILED and fails this cell only; a stop or a full store goes up. ``name``:
    how the console names the run (default: the cell's key).
    """
    name = cell.key if name is None else name
    if isinstance(err, LeaseLost):
        HEARTBEATS.release(sink.run_id)
        return CellOutcome(
            cell, Status.LOST, f"{name}: stopped without logging more: {err}", sink.run_id
        )
    return CellOutcome(
        cell, Status.FAILED, f"{name}: {end_after_error(sink, token, err)}", sink.run_id
    )


def training_outcome(sink: RunSink, token: str, err: BaseException, name: str) -> CellOutcome:
    """A training run's outcome for ``err``, from the ``except`` that caught it (``train_one``).

    The race for a new run lost (``ClaimLost``: another execution's run is the cell's; this one never
    trained): BUSY, the candidate withdrawn. A lost lease: LOST. A non-finite loss: FAILED, with the
    step and epoch as tags. A stop asked for by an observer (``StopTraining``): KILLED, STOPPED. Any
    other error: the run ends as ``end_after_error`` says and ``err`` goes up, for the caller to
    decide what it means (one cell failed, or the execution stops).
    """
    if isinstance(err, ClaimLost):
        HEARTBEATS.release(sink.run_id)
        withdraw_candidate(sink, err)
        return CellOutcome(
            None, Status.BUSY, f"{name}: not trained: {err}", err.winner or sink.run_id
        )
    if isinstance(err, LeaseLost):
        return outcome_of_error(None, sink, token, err, name=name)
    if isinstance(err, NonFiniteLoss):
        sink.set_tags(
            {
                "failure": str(err),
                "nonfinite_loss_step": err.step,
                "nonfinite_loss_epoch": err.epoch,
            }
        )
        return ended(sink, token, "FAILED", Status.FAILED, f"{name}: {err}")
    if isinstance(err, StopTraining):
        sink.set_tags({"stopped": str(err) or "stopped by an observer"})
        return ended(sink, token, "KILLED", Status.STOPPED, f"{name}: stopped ({err})")
    end_after_error(sink, token, err, show_traceback=False)
    raise err  # an error: the run ended FAILED (tag failure); the caller decides what it means


def ended(sink: RunSink, token: str, run_status: str, status: Status, message: str) -> CellOutcome:
    """End a held run with ``run_status`` (released first: no more writes from here) and say ``status``."""
    end_cell(sink, token, run_status)
    return CellOutcome(
        None, status, message, sink.run_id, sink.latest_metrics(), offline=sink.offline
    )


def end_cell(sink: RunSink, token: str, status: str) -> None:
    """End a cell's run as its holder: released first, so the next execution may continue it in place."""
    end_held_run(sink, token, status)


def end_after_error(
    sink: RunSink, token: str, err: BaseException, show_traceback: bool = True
) -> str:
    """End a cell's run for ``err`` and say why; call it from the ``except`` that caught ``err``.

    An error: the run ends FAILED with tag ``failure`` and the caller goes on with the next cell.
    A full or read-only tracking store (``tracking.store.store_errors.explain``): the run ends FAILED
    if the store still takes that, and ``StoreUnwritable`` goes up naming the store. Ctrl-C or
    SIGTERM, also one that came out as another error (``as_stop``: torch's zip writer
    turns one into a ``RuntimeError``): the run ends KILLED with tag ``end_reason`` and the stop
    goes up, so no further cell starts. Any other exit (``SystemExit``) ends it FAILED and goes up.
    ``show_traceback``: print the error's traceback (a caller that raises the error again does not).
    """
    stop = as_stop(err)
    store_problem = explain(err) if isinstance(stop, Exception) else None
    if (
        store_problem
    ):  # a full or read-only store: said once, naming it; no later cell could be recorded either
        with contextlib.suppress(Exception):
            sink.set_tags({"failure": store_problem[:REASON_CHARS]})
            end_cell(sink, token, "FAILED")
        raise StoreUnwritable(store_problem) from err
    if isinstance(stop, Exception):
        if show_traceback:
            traceback.print_exc()
        reason = f"{type(err).__name__}: {err}"
        with contextlib.suppress(Exception):  # never hide the real error behind a logging one
            sink.set_tags({"failure": reason[:REASON_CHARS]})
            end_cell(sink, token, "FAILED")
        return reason
    with contextlib.suppress(Exception):  # never hide the real stop behind a logging error
        sink.set_tags({"end_reason": stop_reason(stop, err)[:REASON_CHARS]})
        end_cell(sink, token, "KILLED" if isinstance(stop, KeyboardInterrupt) else "FAILED")
    if stop is err:
        raise err
    raise stop from err


def end_with_execution(sink: RunSink, token: str, err: BaseException) -> None:
    """End a run this execution holds but is not working on (a transfer cell waiting for its test) as the
    execution ended: KILLED for Ctrl-C or SIGTERM, FAILED otherwise, with tag ``end_reason``; never raises."""
    with contextlib.suppress(Exception):
        sink.set_tags({"end_reason": f"{type(err).__name__}: {err}"[:REASON_CHARS]})
        end_cell(sink, token, "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
