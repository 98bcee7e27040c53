"""Protocol files of every kind: which kind a file holds, and reading one that must be of a given kind.

The parsers are passed in (``workbench.protocol.PARSERS``) rather than imported: an intervention
protocol reads the ablation protocol it acts on through here, so this module imports no kind. Which
kind a file holds is the table's (``workbench.protocol.kinds.kind_of``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from workbench.protocol.common import ProtocolError, read_yaml
from workbench.protocol.kinds import BY_NAME, kind_of

Parsers = dict[str, Callable[..., Any]]  # kind -> parse(data, source=...)


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
        raise ProtocolError(
            f"{path}: is {BY_NAME[kind].article} protocol, not {BY_NAME[expected].article} protocol"
        )
    protocol = parse(data, source=str(path))
    if protocol.name != path.stem:  # names map to files one to one
        raise ProtocolError(
            f"{path}: name {protocol.name!r} must equal the file name stem {path.stem!r}"
        )
    return protocol
