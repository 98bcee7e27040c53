"""Protocol files of every kind: which kind a file holds, and reading one that must be of a given kind.

The parsers are passed in (``workbench.protocol.PARSERS``) rather than imported: an intervention
protocol reads the ablation protocol it acts on through here, so this module imports no kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from workbench.protocol.common import ProtocolError, read_yaml

TRANSFER_MARKERS = ("regimes", "source")
INTERVENTION_MARKER = "interventions"
ATTRIBUTION_MARKER = "attribution"
Parsers = dict[str, Callable[..., Any]]  # kind -> parse(data, source=...)


def kind_of(data: Any) -> str:
    """``intervention`` for parsed content with ``interventions``, ``attribution`` with ``attribution``,
    ``transfer`` with ``regimes`` or ``source``, else ``ablation``."""
    if isinstance(data, dict) and INTERVENTION_MARKER in data:
        return "intervention"
    if isinstance(data, dict) and ATTRIBUTION_MARKER in data:
        return "attribution"
    return (
        "transfer"
        if isinstance(data, dict) and any(k in data for k in TRANSFER_MARKERS)
        else "ablation"
    )


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def load_file(path: str | Path, expected: str | None, parsers: Parsers):
    """Read, validate and hash the protocol file ``path``, which must be of kind ``expected`` (any: None).

    Raises:
        ProtocolError: Unreadable file, bad YAML, unknown key, bad value, another kind than
            ``expected``, or a name other than the file stem.
    """
    path = Path(path)
    data = read_yaml(path)
    kind = kind_of(data)
    parse = parsers.get(kind)
    if expected and kind != expected:
        if parse is not None:
            parse(data, source=str(path))  # a broken file's own problem first: it names the key
        raise ProtocolError(f"{path}: is {_a(kind)} protocol, not {_a(expected)} protocol")
    protocol = parse(data, source=str(path))
    if protocol.name != path.stem:  # names map to files one to one
        raise ProtocolError(
            f"{path}: name {protocol.name!r} must equal the file name stem {path.stem!r}"
        )
    return protocol
