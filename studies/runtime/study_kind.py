"""A study kind's steps, and the one driver that runs any kind: the parent held, the cells, the tally.

A kind (``ablate``'s in-process cells, ``transfer``, ``intervene``, ``attribute``, or a new one) is one class
implementing ``StudyKind``; one instance serves one execution. The driver does what every kind
does the same way:

- ``open_study``: load the protocol (``kind.load``), refuse it if the file is not committed
  (``check_clean``), decide where runs go (``kind.configure_store``), refuse a name already run with
  another hash (``check_frozen``), and say the kind's notice if it has one;
- ``run_cells``: the kind prepares what its cells share (``prepare``: data, a source model; every
  check that can be made before a run opens), then the study's one parent run is held
  (``held_parent``) while each cell runs (``run_cell``), with a progress bar and one
  ``[status] message`` line per cell; a parent that ended FAILED while no cell failed is an error;
- ``run_study``: ``run_cells``, then the one tally line (``studies.runtime.outcome``), the failed
  cells on stderr, and exit status 1 if any cell failed.
"""

from __future__ import annotations

import contextlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from tqdm.auto import tqdm

from studies.runtime.options import StudyOptions
from studies.runtime.outcome import CellOutcome, Status, tally, tally_line
from studies.runtime.stop_signals import sigterm_raises
from studies.runtime.study_execution import held_parent
from studies.runtime.study_protocol import ProtocolError, check_clean, check_frozen
from tracking.record.protocol_runs import frozen_hashes
from tracking.store.session import configure_tracking


class StudyKind(ABC):
    """The steps of one kind of study; one instance per execution (it keeps what its cells share)."""

    #: errors of this kind that are written for the user: the command says them in one line
    user_errors: tuple[type[Exception], ...] = (ProtocolError,)

    @classmethod
    @abstractmethod
    def load(cls, path: str) -> Any:
        """The protocol file parsed and validated (``ProtocolError`` naming the file and key otherwise)."""

    @classmethod
    def configure_store(cls, protocol) -> str:
        """Where this execution's runs go (``configure_tracking``): the configured store, or the local
        fallback store while a server is away; returns its URI."""
        return configure_tracking()

    @classmethod
    def notice(cls, protocol) -> str | None:
        """One line to say once the protocol is open and the store known (ablate: cells trained by other code)."""
        return None

    @abstractmethod
    def prepare(self, protocol, protocol_file: Path, options: StudyOptions) -> str:
        """Load and check what every cell shares, before the parent opens; returns the execution's header line."""

    def parent_tags(self) -> dict:
        """Tags of this kind on the study's parent run."""
        return {}

    def begin(self, parent) -> None:  # noqa: B027 (optional step: a kind overrides what it needs)
        """The parent is held (``parent.run_id``, ``parent.sink``): log what the execution shares on it."""

    def cells(self, protocol) -> list:
        """The protocol's cells, in the order they run (each has a ``key``)."""
        return protocol.cells()

    @abstractmethod
    def run_cell(self, cell, parent) -> CellOutcome | None:
        """Run one cell in its own leased child run of ``parent`` and end that run.

        Any error of the cell becomes a FAILED outcome; Ctrl-C, SIGTERM and a full store go up.
        None: the cell is held for a later phase of this execution (``deferred``).
        """

    def deferred(self, parent) -> Iterator[CellOutcome]:
        """The outcomes of the cells ``run_cell`` held, once every cell had its turn (transfer: the test phase)."""
        return iter(())

    def abandon(self, err: BaseException) -> None:  # noqa: B027 (optional step)
        """The execution ends with ``err`` (Ctrl-C, SIGTERM, a full store): end the held cells' runs as it ended."""

    def end(self, parent, outcomes: list[CellOutcome]) -> None:  # noqa: B027 (optional step)
        """Every cell had its turn; the parent is still held (a kind's summary on it)."""

    def summary_lines(self, outcomes: list[CellOutcome]) -> list[str]:
        """Lines said after the tally line (intervene: where the time went)."""
        return []


def open_study(kind: type[StudyKind], path: str, allow_dirty: bool, store=None):
    """Load the protocol, check it is committed and frozen, with tracking configured (``store(protocol)``,
    default the kind's ``configure_store``); errors name the file or key."""
    protocol = kind.load(path)
    check_clean(path, allow_dirty)
    (store or kind.configure_store)(protocol)
    check_frozen(protocol, frozen_hashes(protocol.name))
    notice = kind.notice(protocol)
    if notice:
        click.echo(notice)
    return protocol


def run_cells(
    kind: StudyKind, protocol, protocol_file: Path, options: StudyOptions
) -> list[CellOutcome]:
    """Every cell of ``protocol`` under the study's one parent run; returns the outcomes in the order they ended.

    However the execution ends (done, a failed cell, Ctrl-C, SIGTERM, a full store) the parent and
    every run this execution holds end with a status that says so. The exit status agrees with the
    record: a parent that ended FAILED though no cell failed here raises (before: exit 0).
    """
    tqdm.write(kind.prepare(protocol, Path(protocol_file), options))
    cells = kind.cells(protocol)
    outcomes: list[CellOutcome] = []
    with (
        sigterm_raises(),
        held_parent(
            protocol,
            Path(protocol_file),
            options.allow_dirty,
            kind.parent_tags(),
            subset=len(cells) < len(protocol.cells()),
        ) as parent,
    ):
        kind.begin(parent)
        with tqdm(total=len(cells), desc=f"{protocol.name} cells", unit="cell") as bar:

            def ended(outcome: CellOutcome) -> None:
                tqdm.write(f"[{outcome.status}] {outcome.message}")
                outcomes.append(outcome)
                bar.update(1)

            try:
                for cell in cells:
                    bar.set_postfix_str(cell.key)
                    outcome = kind.run_cell(cell, parent)
                    if outcome is not None:
                        ended(outcome)
                for outcome in kind.deferred(parent):
                    ended(outcome)
            except BaseException as err:
                kind.abandon(err)
                raise
        kind.end(parent, outcomes)
    if parent.status == "FAILED" and not any(o.status == Status.FAILED for o in outcomes):
        cells_line = ", ".join(
            f"{n} {what}" for what, n in (parent.execution.get("cells") or {}).items() if n
        )
        raise click.ClickException(
            f"parent run {parent.run_id} ended FAILED (cells: {cells_line or 'none counted'})"
        )
    return outcomes


def say_tally(outcomes: list[CellOutcome], extra_lines: list[str] = ()) -> None:
    """The one tally line, the kind's lines after it, then each failed cell on stderr."""
    click.echo(tally_line(tally(outcomes)))
    for line in extra_lines:
        click.echo(line)
    for outcome in outcomes:
        if outcome.status == Status.FAILED:
            click.echo(f"  FAILED {outcome.message}", err=True)


@contextlib.contextmanager
def said_in_one_line(kind: type[StudyKind] | StudyKind):
    """The kind's ``user_errors`` as click errors: one line, exit status 1, no traceback."""
    try:
        yield
    except kind.user_errors as err:
        raise click.ClickException(str(err)) from err


def run_study(
    kind: StudyKind, protocol, protocol_file: Path, options: StudyOptions
) -> list[CellOutcome]:
    """A study command's execution: ``run_cells``, the tally, and exit status 1 if a cell failed.

    The kind's ``user_errors`` are said in one line (a click error), before any run opens when they
    can be checked then.
    """
    with said_in_one_line(kind):
        outcomes = run_cells(kind, protocol, protocol_file, options)
    say_tally(outcomes, kind.summary_lines(outcomes))
    if any(o.status == Status.FAILED for o in outcomes):
        sys.exit(1)
    if outcomes and all(o.status in (Status.FINISHED, Status.SKIPPED) for o in outcomes):
        click.echo(f"report: workbench report --protocol {protocol.name}")  # what to run next
    return outcomes
