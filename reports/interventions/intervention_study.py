"""What the intervention report reads (``reports.common.readout``): per chosen cell, its outcomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from reports.common.readout import Readout, load_readout
from tracking.kinds import intervention_runs
from workbench.protocol import InterventionProtocol


@dataclass
class InterventionReadout(Readout):
    """Every cell run of the hash, the run chosen per cell and its outcomes."""

    kind: ClassVar[str] = "intervention"
    protocol: InterventionProtocol
    cells: dict[tuple[str, int], intervention_runs.CellResult]


def load_study(protocol: InterventionProtocol, digest: str) -> InterventionReadout:
    """The readout from the MLflow store: each cell's newest finished run and its logged outcomes."""
    return load_readout(InterventionReadout, protocol, digest, intervention_runs, "intervene")
