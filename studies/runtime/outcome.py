"""What became of one cell in one execution, in a closed vocabulary, and the one tally line of a study.

Every study kind (``ablate`` in process, ``transfer``, ``intervene``, ``attribute``; a new kind too) returns a
``CellOutcome`` per cell and ends with ``tally_line``; ``train_one`` returns one for a run that is
not a protocol cell (``workbench train``, a sweep trial: ``cell`` is None). The statuses are an
enum: an outcome with any other status is refused when it is made, so a console line, a tally
and an exit status can never disagree about a word.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """What became of a cell (a str: ``Status.FINISHED == "finished"``, as the queue records it)."""

    FINISHED = "finished"  # it ran to its end in this execution and its run ended FINISHED
    SKIPPED = "skipped"  # a finished run of this cell (this code) exists already: nothing done
    FAILED = "failed"  # its run ended FAILED (an error, a failed proof), or it failed before a run opened
    BUSY = "busy"  # another live execution holds its run (or created it first): not touched
    LOST = "lost"  # its lease was taken over while it ran: stopped without writing more
    STOPPED = "stopped"  # an observer stopped the training (a sweep's pruning, a test): run KILLED


@dataclass(frozen=True)
class CellOutcome:
    """One cell's outcome: its status, the console message, its run and the run's latest metrics."""

    cell: Any  # the kind's cell (it has a ``key``); None for a run that is not a protocol cell
    status: Status
    message: str
    run_id: str | None = None
    # the run's latest metrics, wherever the run is logged
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0  # evaluation wall time where a kind measures it (intervene); 0 otherwise
    offline: bool = False  # logged to the local fallback store (see `workbench sync`)

    def __post_init__(self) -> None:
        try:
            status = Status(self.status)
        except ValueError:
            raise ValueError(
                f"cell outcome status {self.status!r}: not one of "
                f"{', '.join(s.value for s in Status)}"
            ) from None
        object.__setattr__(self, "status", status)


def tally(outcomes: Iterable[CellOutcome]) -> dict[Status, int]:
    """How many cells ended with each status (every status present, 0 where none)."""
    counts = dict.fromkeys(Status, 0)
    for outcome in outcomes:
        counts[outcome.status] += 1
    return counts


def tally_line(counts: dict[Status, int]) -> str:
    """The one summary line of a study execution: ``cells: N run, N already finished (skipped), N failed, ...``.

    Busy, lost and stopped cells are named only when there are any.
    """
    line = (
        f"cells: {counts[Status.FINISHED]} run, {counts[Status.SKIPPED]} already finished (skipped), "
        f"{counts[Status.FAILED]} failed"
    )
    for status, words in (
        (Status.BUSY, "held by another live execution (not touched)"),
        (Status.LOST, "taken over by another execution"),
        (Status.STOPPED, "stopped by an observer"),
    ):
        if counts[status]:
            line += f", {counts[status]} {words}"
    return line
