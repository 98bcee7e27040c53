"""Protocol files of every kind: which kind a file holds, and reading one that must be of a given kind.

The parsers come from the table of kinds (``workbench.kinds``), imported when a file is
read: an intervention protocol reads the ablation protocol it acts on through here, so this module
imports no kind. Which kind a file holds is the table's (``kind_of``).
"""

from __future__ import annotations

from pathlib import Path

from workbench.protocol.common import ProtocolError, read_yaml
from workbench.kinds import BY_NAME, kind_of, parsers


def load_file(path: str | Path, expected: str | None):
    """Read, validate and hash the protocol file ``path``, which must be of kind ``expected`` (any: None).

    Raises:
        ProtocolError: Unreadable file, bad YAML, unknown key, bad value, another kind than
            ``expected``, or a name other than the file stem.
    """
    path = Path(path)
    data = read_yaml(path)
    kind = kind_of(data)
    parse = parsers()[kind]
    if expected and kind != expected:
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
