"""What the attribution report reads (``reports.common.readout``): per chosen cell, its arrays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from reports.common.readout import Readout, load_readout
from tracking.kinds import attribution_runs
from workbench.protocol import AttributionProtocol


@dataclass
class AttributionReadout(Readout):
    """Every cell run of the hash, the run chosen per cell and its per-image arrays."""

    kind: ClassVar[str] = "attribution"
    protocol: AttributionProtocol
    cells: dict[tuple[str, int], attribution_runs.CellResult]


def load_study(protocol: AttributionProtocol, digest: str) -> AttributionReadout:
    """The readout from the MLflow store: each cell's newest finished run and its logged per-image arrays."""
    return load_readout(AttributionReadout, protocol, digest, attribution_runs, "attribute")
