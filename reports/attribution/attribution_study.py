"""An attribution study as its report reads it: the cell runs of a hash and what each chosen one logged.

Read from the MLflow store (``load_study``) or back from an evidence export
(``reports.attribution.attribution_evidence.load_attribution_evidence``); the report
(``reports.attribution.attribution_report``) is computed from either the same way.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from reports.collect import ReportError, shown_path
from tracking.kinds import attribution_runs
from tracking.record import queries
from workbench.protocol import SHORT_HASH_LEN, AttributionProtocol


@dataclass
class AttributionStudy:
    """Every cell run of the hash, the run chosen per cell and its per-image arrays."""

    protocol: AttributionProtocol
    digest: str
    chosen: dict[tuple[str, int], queries.CellRecord]
    records: list[queries.CellRecord]
    cells: dict[tuple[str, int], attribution_runs.CellResult]
    tracking_uri: str
    rebuilt_from: str = ""  # the evidence export it was read from ("" when read from the store)


def load_study(protocol: AttributionProtocol, digest: str) -> AttributionStudy:
    """The study from the MLflow store: each cell's newest finished run and its logged arrays."""
    chosen, records = attribution_runs.finished_cells(protocol.name, digest)
    if not chosen:
        raise ReportError(
            f"{protocol.name}@{digest[:SHORT_HASH_LEN]}: no finished attribution cells; run "
            f"`workbench attribute --protocol {shown_path(Path(protocol.source_file))}` first"
        )
    with tempfile.TemporaryDirectory() as tmp:
        cells = {
            key: attribution_runs.read_cell(record, Path(tmp)) for key, record in chosen.items()
        }
    return AttributionStudy(protocol, digest, chosen, records, cells, queries.tracking_uri())
