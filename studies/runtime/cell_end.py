"""How a study cell's run ends when its holder ends it: done, failed, or stopped by the user.

Shared by ``transfer`` and ``intervene``, whose cells are leased runs that this execution holds
(``ablate`` ends its runs inside ``studies.ablation.train``, with the same rules).
"""

from __future__ import annotations

import contextlib
import traceback

import click

from studies.runtime.stop_signals import as_stop, stop_reason
from tracking.record.lease import HEARTBEATS, RELEASED_TAG
from tracking.record.sink import RunSink
from tracking.store.store_errors import explain


class StoreUnwritable(click.ClickException):
    """The tracking store cannot take more writes (full, read-only): every later cell would fail the same way."""


REASON_CHARS = 500


def end_cell(sink: RunSink, token: str, status: str) -> None:
    """End a cell's run as its holder: released first, so the next execution may continue it in place."""
    HEARTBEATS.release(sink.run_id)
    sink.set_tags({RELEASED_TAG: token})
    sink.end(status)


def end_after_error(sink: RunSink, token: str, err: BaseException) -> str:
    """End a cell's run for ``err`` and say why; call it from the ``except`` that caught ``err``.

    An error: the run ends FAILED with tag ``failure`` and the caller goes on with the next cell.
    A full or read-only tracking store (``tracking.store.store_errors.explain``): the run ends FAILED
    if the store still takes that, and ``StoreUnwritable`` goes up naming the store. Ctrl-C or
    SIGTERM, also one that came out as another error (``as_stop``: torch's zip writer
    turns one into a ``RuntimeError``): the run ends KILLED with tag ``end_reason`` and the stop
    goes up, so no further cell starts. Any other exit (``SystemExit``) ends it FAILED and goes up.
    """
    stop = as_stop(err)
    store_problem = explain(err) if isinstance(stop, Exception) else None
    if store_problem:  # a full or read-only store: said once, naming it; no later cell could be recorded either
        with contextlib.suppress(Exception):
            sink.set_tags({"failure": store_problem[:REASON_CHARS]})
            end_cell(sink, token, "FAILED")
        raise StoreUnwritable(store_problem) from err
    if isinstance(stop, Exception):
        traceback.print_exc()
        reason = f"{type(err).__name__}: {err}"
        sink.set_tags({"failure": reason[:REASON_CHARS]})
        end_cell(sink, token, "FAILED")
        return reason
    with contextlib.suppress(Exception):  # never hide the real stop behind a logging error
        sink.set_tags({"end_reason": stop_reason(stop, err)[:REASON_CHARS]})
        end_cell(sink, token, "KILLED" if isinstance(stop, KeyboardInterrupt) else "FAILED")
    if stop is err:
        raise err
    raise stop from err
