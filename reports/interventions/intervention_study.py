"""An intervention study as its report reads it: the cell runs of a hash and what each chosen one logged.

Read from the MLflow store (``load_study``) or back from an evidence export
(``reports.interventions.intervention_evidence.load_intervention_evidence``); the report
(``reports.interventions.intervention_report``) is computed from either the same way.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from reports.collect import ReportError, shown_path
from tracking.kinds import intervention_runs
from tracking.record import queries
from workbench.protocol import SHORT_HASH_LEN, InterventionProtocol


@dataclass
class InterventionStudy:
    """What the report is computed from: every cell run of the hash, the run chosen per cell and
    what each chosen run logged (from the store, or read back from an evidence export)."""

    protocol: InterventionProtocol
    digest: str
    chosen: dict[tuple[str, int], queries.CellRecord]
    records: list[queries.CellRecord]
    cells: dict[tuple[str, int], intervention_runs.CellResult]
    tracking_uri: str
    rebuilt_from: str = ""  # the evidence export it was read from ("" when read from the store)


def load_study(protocol: InterventionProtocol, digest: str) -> InterventionStudy:
    """The study from the MLflow store: each cell's newest finished run and its logged outcomes."""
    chosen, records = intervention_runs.finished_cells(protocol.name, digest)
    if not chosen:
        raise ReportError(
            f"{protocol.name}@{digest[:SHORT_HASH_LEN]}: no finished intervention cells; run "
            f"`workbench intervene --protocol {shown_path(Path(protocol.source_file))}` first"
        )
    with tempfile.TemporaryDirectory() as tmp:
        cells = {
            key: intervention_runs.read_cell(record, Path(tmp)) for key, record in chosen.items()
        }
    return InterventionStudy(protocol, digest, chosen, records, cells, queries.tracking_uri())
