"""What the intervention report reads (``reports.common.readout``): per chosen cell, its outcomes."""

from __future__ import annotations

from dataclasses import dataclass

from reports.common.readout import Readout
from tracking.kinds import intervention_runs
from workbench.protocol import InterventionProtocol


@dataclass
class InterventionReadout(
    Readout, kind="intervention", runs=intervention_runs, command="intervene"
):
    """Every cell run of the hash, the run chosen per cell and its outcomes."""

    protocol: InterventionProtocol
    cells: dict[tuple[str, int], intervention_runs.InterventionCellResult]
