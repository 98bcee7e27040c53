"""A transfer study as its report reads it: the cell runs of a hash, the execution that picks them, the logged files.

Read from the MLflow store (``load_data``) or back from an evidence export
(``reports.transfer.transfer_evidence.load_transfer_evidence``); the report
(``reports.transfer.transfer_report``) is computed from either the same way, through
``section``, so a rebuild shows the same numbers as the store build.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from reports.transfer.transfer_blocks import CURVE_METRICS
from tracking.export import run_export
from tracking.kinds import transfer_runs
from tracking.record import queries
from tracking.record.queries import CellRecord
from tracking.record.schema import SOURCE_IDENTITY
from workbench.protocol import TransferProtocol
from workbench.train.evaluate import read_predictions
from workbench.transfer.report import TransferSection

PREDICTIONS = "predictions"  # the artifact folder of a cell's logged predictions/<split>.csv
# what a transfer cell logs there (tracking.kinds.transfer_runs: log_selection, log_test)
SPLITS = (
    "val",
    "test",
)


@dataclass
class ReportedCell:
    """A chosen cell run: its logged prediction files (split -> the bytes of ``predictions/<split>.csv``)
    and the per-epoch metrics the curves and the cost table read (metric -> step -> value)."""

    record: CellRecord
    files: dict[str, bytes]
    curves: dict[str, dict[int, float]] = field(default_factory=dict)


@dataclass
class TransferReportData:
    """What the transfer report is computed from (from the store, or read back from an evidence export).

    Attributes:
        protocol: The protocol of ``digest``; ``protocol_text`` is the file it parses from.
        source: Where the protocol came from, as the header says it.
        execution: The newest transfer execution of the hash (``run_id``, ``params``, ``tags``):
            its source identity picks the cells, its params are the section's settings and source.
        parents: Every parent run id of the hash, newest first (the report is logged to the first).
        records: Every cell run of the hash, any status.
        cells: (regime, seed) -> the chosen run and its files.
        tracking_uri: The store as the report names it (credentials removed).
    """

    protocol: TransferProtocol
    protocol_text: str
    digest: str
    source: str
    execution: dict
    parents: list[str]
    records: list[CellRecord]
    cells: dict[tuple[str, int], ReportedCell]
    tracking_uri: str
    rebuilt_from: str = ""  # the evidence export it was read from ("" when read from the store)

    @property
    def chosen(self) -> dict[tuple[str, int], CellRecord]:
        return {key: cell.record for key, cell in self.cells.items()}


def published(record: dict) -> dict:
    """A run's params and tags as a page may print them: secrets removed, absolute paths made relative.
    Applied when reading from the store too, so both builds print the same strings."""
    return {
        "run_id": record["run_id"],
        "params": {k: run_export.clean_text(v) for k, v in sorted(record["params"].items())},
        "tags": {k: run_export.clean_text(v) for k, v in sorted(record["tags"].items())},
    }


def _files(run_id: str, folder: Path) -> dict[str, bytes]:
    """The run's logged ``predictions/<split>.csv`` as bytes: test (what the report reads) and
    validation (the selected epoch's, logged at selection) when the run has it."""
    out = {}
    for split in SPLITS:
        artifact = f"{PREDICTIONS}/{split}.csv"
        if split == "test" or queries.has_artifact(run_id, artifact):
            out[split] = queries.download_artifact(run_id, artifact, folder / run_id).read_bytes()
    return out


def load_data(
    protocol: TransferProtocol, protocol_text: str, digest: str, source: str
) -> TransferReportData:
    """The study from the MLflow store.

    Raises:
        LookupError: No transfer execution of the hash, or no finished cell of its source.
    """
    execution = published(transfer_runs.newest_execution(protocol.name, digest))
    records = queries.cell_records(protocol.name, digest)
    identity = execution["tags"].get(SOURCE_IDENTITY, "")
    chosen = transfer_runs.choose_cells(records, identity)
    if not chosen:
        raise LookupError(f"{protocol.name}@{digest[:12]}: no finished cells for source {identity}")
    with tempfile.TemporaryDirectory() as tmp:
        cells = {
            key: ReportedCell(
                r,
                _files(r.run_id, Path(tmp)),
                {k: queries.metric_history(r.run_id, k) for k in CURVE_METRICS},
            )
            for key, r in chosen.items()
        }
    parents = [p.run_id for p in queries.parent_runs(protocol.name, digest)]
    return TransferReportData(
        protocol,
        protocol_text,
        digest,
        source,
        execution,
        parents,
        records,
        cells,
        queries.tracking_uri(),
    )


def compute_section(data: TransferReportData, n_resamples: int) -> TransferSection:
    """The report's numbers, from the chosen cells' test predictions (no store is read)."""
    cells = [
        transfer_runs.cell_predictions(c.record, read_predictions(io.BytesIO(c.files["test"])))
        for c in data.cells.values()
    ]
    return transfer_runs.section_of(
        data.protocol.name, data.digest, data.execution["params"], cells, n_resamples
    )
