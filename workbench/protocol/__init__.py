"""The one protocol schema: frozen study protocols of every kind, validated, typed and hashed.

Read by ``studies`` (ablate, transfer, sweep, worker), ``reports`` and the transfer library
alike, so there is one parser, one canonical form and one hash:

- ``common``: the YAML reader (YAML 1.2 scalars, duplicate keys refused), the validator
  (keys from the config dataclasses, values checked against their type hints, errors naming
  the dotted key), ``canonical_json`` and the hash, ``check_frozen``;
- ``ablation``: arms × seeds training registry models from scratch (``Protocol``);
- ``transfer``: regimes × seeds adapting one source checkpoint (``TransferProtocol``);
- ``intervention``: a grid of interventions on trained cells or a pretrained ViT
  (``InterventionProtocol``);
- ``attribution``: attribution methods scored against exact causal effects on trained cells or a
  pretrained ViT (``AttributionProtocol``).

``load_any`` reads a file of any kind; which kind a file holds, by its top-level keys, is the one
table of kinds' (``kinds``: ``interventions`` an intervention protocol, ``attribution`` an
attribution protocol, ``regimes`` or ``source`` a transfer protocol, any other an ablation one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.protocol.ablation import SPLIT_KEYS, Arm, Cell, Protocol, parse_protocol
from workbench.protocol.attribution import (
    AttributionProtocol,
    AttributionProtocolError,
    parse_attribution_protocol,
)
from workbench.protocol.common import (
    SCHEMA_VERSION,
    SHORT_HASH_LEN,
    ProtocolError,
    ProtocolFrozenError,
    canonical_json,
    check_frozen,
    read_yaml,
)
from workbench.protocol.files import load_file
from workbench.kinds import kind_of, parsers
from workbench.protocol.intervention import (
    InterventionCell,
    InterventionProtocol,
    InterventionProtocolError,
    parse_intervention_protocol,
)
from workbench.protocol.transfer import (
    Evaluation,
    Regime,
    SourceSpec,
    TransferCell,
    TransferData,
    TransferProtocol,
    TransferProtocolError,
    TransferRunSpec,
    parse_transfer_protocol,
)

__all__ = [
    "AttributionProtocol",
    "AttributionProtocolError",
    "parse_attribution_protocol",
    "load_attribution_protocol",
    "SCHEMA_VERSION",
    "SHORT_HASH_LEN",
    "SPLIT_KEYS",
    "Arm",
    "Cell",
    "Evaluation",
    "InterventionCell",
    "InterventionProtocol",
    "InterventionProtocolError",
    "Protocol",
    "ProtocolError",
    "ProtocolFrozenError",
    "Regime",
    "SourceSpec",
    "TransferCell",
    "TransferData",
    "TransferProtocol",
    "TransferProtocolError",
    "TransferRunSpec",
    "canonical_json",
    "check_frozen",
    "kind_of",
    "load_any",
    "load_intervention_protocol",
    "load_protocol",
    "load_transfer_protocol",
    "parse_any",
    "parse_intervention_protocol",
    "parse_protocol",
    "parse_transfer_protocol",
    "read_yaml",
]

AnyProtocol = Protocol | TransferProtocol | InterventionProtocol | AttributionProtocol


def parse_any(data: Any, source: str = "<protocol>") -> AnyProtocol:
    """Validate parsed content of any kind."""
    return parsers()[kind_of(data)](data, source=source)


def _load(path: str | Path, expected: str | None) -> AnyProtocol:
    return load_file(path, expected)


def load_any(path: str | Path) -> AnyProtocol:
    """Read, validate and hash a protocol file of any kind.

    Raises:
        ProtocolError: Unreadable file, bad YAML, unknown key, bad value, or a name other
            than the file stem.
    """
    return _load(path, None)


def load_protocol(path: str | Path) -> Protocol:
    """Read, validate and hash an ablation protocol file (``ProtocolError`` otherwise)."""
    return _load(path, "ablation")


def load_transfer_protocol(path: str | Path) -> TransferProtocol:
    """Read, validate and hash a transfer protocol file (``ProtocolError`` otherwise)."""
    return _load(path, "transfer")


def load_intervention_protocol(path: str | Path) -> InterventionProtocol:
    """Read, validate and hash an intervention protocol file (``ProtocolError`` otherwise)."""
    return _load(path, "intervention")


def load_attribution_protocol(path: str | Path) -> AttributionProtocol:
    """Read, validate and hash an attribution protocol file (``ProtocolError`` otherwise)."""
    return _load(path, "attribution")
