"""The one table of protocol kinds: what marks a file of each kind, its command, its title.

Everything that tells kinds apart reads this table: ``kind_of`` (which kind a parsed file holds),
the parsers (``workbench.protocol.PARSERS``, one per row), the key reference
(``workbench.protocol.keys``), the store's ``protocol_kind`` (a study parent carries its kind's
name as a tag, ablation none) and the report builder (``reports.build``, one report per row).
Adding a kind is a row here and, per kind, its parser, its study kind, its tracking and its
report (docs/architecture.md, "Adding a kind"). This module imports no kind, so the parsers can
use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProtocolKind:
    """One kind of protocol.

    Attributes:
        name: The kind's name; also the tag (value ``true``) on its study parents, except ablation's.
        markers: Top-level keys of which any one makes a file this kind (ablation: none, the default).
        command: The ``workbench`` command that runs a protocol of this kind.
        title: What a protocol of this kind is, in the key reference's heading.
    """

    name: str
    markers: tuple[str, ...]
    command: str
    title: str

    @property
    def heading(self) -> str:
        """The key reference's heading of the kind."""
        return f"{self.name.capitalize()} protocol (`workbench {self.command}`): {self.title}"

    @property
    def article(self) -> str:
        """The name with its article ("an intervention")."""
        return f"an {self.name}" if self.name[0] in "aeiou" else f"a {self.name}"


# In the order the key reference and `workbench protocol keys --kind` list them.
PROTOCOL_KINDS = (
    ProtocolKind("ablation", (), "ablate", "arms x seeds, each cell trained from scratch"),
    ProtocolKind(
        "transfer",
        ("regimes", "source"),
        "transfer",
        "regimes x seeds from one source checkpoint",
    ),
    ProtocolKind(
        "intervention",
        ("interventions",),
        "intervene",
        "a grid of interventions on trained cells",
    ),
    ProtocolKind(
        "attribution",
        ("attribution",),
        "attribute",
        "attribution maps scored against exact causal effects",
    ),
)
KINDS = tuple(k.name for k in PROTOCOL_KINDS)
BY_NAME = {k.name: k for k in PROTOCOL_KINDS}
DEFAULT_KIND = "ablation"  # a file with no kind's marker
# The order markers are tried in: a file with ``interventions`` is an intervention protocol whatever
# else it holds (its parser then names any key that does not belong).
DETECTION_ORDER = ("intervention", "attribution", "transfer")


def kind_of(data: Any) -> str:
    """The kind of parsed protocol content: the first kind (``DETECTION_ORDER``) one of whose
    markers is a top-level key, else ``ablation``."""
    if isinstance(data, dict):
        for name in DETECTION_ORDER:
            if any(marker in data for marker in BY_NAME[name].markers):
                return name
    return DEFAULT_KIND
