"""What the report of a kind that acts on trained models is computed from: its readout.

A readout is every cell run of the protocol's hash, the run chosen per cell and what each chosen
run logged, read from the MLflow store (``load_readout``) or back from an evidence export; the
report is computed from either the same way. Each kind's readout (``InterventionReadout``,
``AttributionReadout``) names the protocol and cell types.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from reports.collect import ReportError, shown_path
from tracking.record import queries
from workbench.protocol import SHORT_HASH_LEN


@dataclass
class Readout:
    """Every cell run of the hash, the run chosen per cell and what each chosen run logged."""

    kind: ClassVar[str] = ""  # the kind in one word, for messages
    runs: ClassVar[ModuleType]  # the kind's tracking module (``finished_cells``, ``read_cell``)
    command: ClassVar[str] = ""  # the command that runs the protocol ("intervene")
    protocol: Any
    digest: str
    chosen: dict[tuple[str, int], queries.CellRecord]
    records: list[queries.CellRecord]
    cells: dict[tuple[str, int], Any]
    tracking_uri: str
    rebuilt_from: str = ""  # the evidence export it was read from ("" when read from the store)

    def __init_subclass__(cls, *, kind: str, runs: ModuleType, command: str, **options) -> None:
        """A kind's readout names them in its class line: ``class X(Readout, kind=..., ...)``."""
        super().__init_subclass__(**options)
        cls.kind, cls.runs, cls.command = kind, runs, command

    @classmethod
    def from_store(cls, protocol, digest: str):
        """The readout from the MLflow store (``load_readout`` with the kind's module and command)."""
        return load_readout(cls, protocol, digest, cls.runs, cls.command)


def load_readout(readout: type[Readout], protocol, digest: str, runs: ModuleType, command: str):
    """The readout from the MLflow store: each cell's newest finished run and what it logged.

    Args:
        readout: The kind's readout class.
        runs: The kind's tracking module (``finished_cells``, ``read_cell``).
        command: The command that runs the protocol ("intervene"), for the error with no cells.
    """
    chosen, records = runs.finished_cells(protocol.name, digest)
    if not chosen:
        raise ReportError(
            f"{protocol.name}@{digest[:SHORT_HASH_LEN]}: no finished {readout.kind} cells; run "
            f"`workbench {command} --protocol {shown_path(Path(protocol.source_file))}` first"
        )
    with tempfile.TemporaryDirectory() as tmp:
        cells = {key: runs.read_cell(record, Path(tmp)) for key, record in chosen.items()}
    return readout(protocol, digest, chosen, records, cells, queries.tracking_uri())
