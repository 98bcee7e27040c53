"""What the attribution report reads (``reports.common.readout``): per chosen cell, its arrays."""

from __future__ import annotations

from dataclasses import dataclass

from reports.common.readout import Readout
from tracking.kinds import attribution_runs
from workbench.protocol import AttributionProtocol


@dataclass
class AttributionReadout(Readout, kind="attribution", runs=attribution_runs, command="attribute"):
    """Every cell run of the hash, the run chosen per cell and its per-image arrays."""

    protocol: AttributionProtocol
    cells: dict[tuple[str, int], attribution_runs.AttributionCellResult]
