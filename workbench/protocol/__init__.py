"""The one protocol schema: frozen study protocols of every kind, validated, typed and hashed.

Read by ``studies`` (ablate, transfer, sweep, worker), ``reports`` and the transfer library
alike, so there is one parser, one canonical form and one hash:

- ``common``: the YAML reader (YAML 1.2 scalars, duplicate keys refused), the validator
  (keys from the config dataclasses, values checked against their type hints, errors naming
  the dotted key), ``canonical_json`` and the hash, ``check_frozen``;
- ``ablation``: arms × seeds training registry models from scratch (``Protocol``);
- ``transfer``: regimes × seeds adapting one source checkpoint (``TransferProtocol``);
- ``intervention``: a grid of interventions on trained cells or a pretrained ViT
  (``InterventionProtocol``).

``load_any`` reads a file of any kind; a file with ``interventions`` is an intervention
protocol, one with ``regimes`` (or ``source``) a transfer protocol, any other an ablation protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.protocol.ablation import SPLIT_KEYS, Arm, Cell, Protocol, parse_protocol
from workbench.protocol.common import (
    SCHEMA_VERSION,
    SHORT_HASH_LEN,
    ProtocolError,
    ProtocolFrozenError,
    canonical_json,
    check_frozen,
    read_yaml,
)
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
    "SCHEMA_VERSION", "SHORT_HASH_LEN", "SPLIT_KEYS", "Arm", "Cell", "Evaluation", "InterventionCell",
    "InterventionProtocol", "InterventionProtocolError", "Protocol", "ProtocolError",
    "ProtocolFrozenError", "Regime", "SourceSpec", "TransferCell", "TransferData", "TransferProtocol",
    "TransferProtocolError", "TransferRunSpec", "canonical_json", "check_frozen", "kind_of", "load_any",
    "load_intervention_protocol", "load_protocol", "load_transfer_protocol", "parse_any", "parse_intervention_protocol",
    "parse_protocol", "parse_transfer_protocol", "read_yaml",
]

TRANSFER_MARKERS = ("regimes", "source")
INTERVENTION_MARKER = "interventions"
AnyProtocol = Protocol | TransferProtocol | InterventionProtocol


def kind_of(data: Any) -> str:
    """``intervention`` for parsed content with ``interventions``, ``transfer`` with ``regimes`` or
    ``source``, else ``ablation``."""
    if isinstance(data, dict) and INTERVENTION_MARKER in data:
        return "intervention"
    return "transfer" if isinstance(data, dict) and any(k in data for k in TRANSFER_MARKERS) else "ablation"


def parse_any(data: Any, source: str = "<protocol>") -> AnyProtocol:
    """Validate parsed content of any kind."""
    parse = {"transfer": parse_transfer_protocol, "intervention": parse_intervention_protocol}.get(
        kind_of(data), parse_protocol)
    return parse(data, source=source)


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _load(path: str | Path, expected: str | None) -> AnyProtocol:
    path = Path(path)
    data = read_yaml(path)
    kind = kind_of(data)
    if expected and kind != expected:
        parse_any(data, source=str(path))  # a broken file's own problem first: it names the key
        raise ProtocolError(f"{path}: is {_a(kind)} protocol, not {_a(expected)} protocol")
    protocol = parse_any(data, source=str(path))
    if protocol.name != path.stem:  # names map to files one to one
        raise ProtocolError(f"{path}: name {protocol.name!r} must equal the file name stem {path.stem!r}")
    return protocol


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
