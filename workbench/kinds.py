"""The one table of protocol kinds: what marks a file of each kind, and where each part of a kind lives.

Each row names the kind's parser, its rows of the key reference, its command and its report
builder as ``module:attribute`` paths, loaded only when used (``ProtocolKind.load``), so that
this module imports no kind and every layer reads the one table: the library loads parsers and
key rows, ``studies.cli`` loads commands, ``reports.build`` loads report builders. Nothing else
tells kinds apart by name (tests/test_architecture.py refuses a dict or a comparison keyed by a
kind's name anywhere else). Adding a kind is a row here plus the kind's own files
(docs/architecture.md, "Adding a kind").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class ProtocolKind:
    """One kind of protocol.

    Attributes:
        name: The kind's name; also the tag (value ``true``) on its study parents, except ablation's.
        markers: Top-level keys of which any one makes a file this kind (ablation: none, the default).
        command: The ``workbench`` command that runs a protocol of this kind.
        title: What a protocol of this kind is, in the key reference's heading.
        help: The command's one line in ``workbench --help`` (its docstring's first line).
        parser: ``module:function`` parsing the file's content: ``(data, source=...)`` -> protocol.
        key_rows: ``module:function`` giving the kind's rows of the key reference.
        runner: ``module:command``, the click command that runs the protocol.
        report: ``module:object`` building and rebuilding its report (``reports.build`` says what
            the object answers).
        unit: What one row of its configuration table is (an arm, a regime, ...).
    """

    name: str
    markers: tuple[str, ...]
    command: str
    title: str
    help: str
    parser: str
    key_rows: str
    runner: str
    report: str
    unit: str

    @property
    def heading(self) -> str:
        """The key reference's heading of the kind."""
        return f"{self.name.capitalize()} protocol (`workbench {self.command}`): {self.title}"

    @property
    def article(self) -> str:
        """The name with its article ("an intervention")."""
        return f"an {self.name}" if self.name[0] in "aeiou" else f"a {self.name}"

    def load(self, part: str) -> Any:
        """The object a ``module:attribute`` field (``parser``, ``key_rows``, ``runner``,
        ``report``) names, imported now."""
        return load_path(getattr(self, part))


@cache
def load_path(path: str) -> Any:
    """``"package.module:attribute"`` -> that attribute, its module imported on first use."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


# In the order the key reference and `workbench protocol keys --kind` list them.
PROTOCOL_KINDS = (
    ProtocolKind(
        name="ablation",
        markers=(),
        command="ablate",
        title="arms x seeds, each cell trained from scratch",
        help="Run (or resume) a frozen protocol: every arm at every seed, as MLflow child runs.",
        parser="workbench.protocol.ablation:parse_protocol",
        key_rows="workbench.protocol.keys:ablation_rows",
        runner="studies.ablation.ablate:ablate",
        report="reports.build:ABLATION_REPORT",
        unit="arm",
    ),
    ProtocolKind(
        name="transfer",
        markers=("regimes", "source"),
        command="transfer",
        title="regimes x seeds from one source checkpoint",
        help="Run (or resume) a transfer protocol: linear probe, partial and full fine-tuning at paired seeds.",
        parser="workbench.protocol.transfer:parse_transfer_protocol",
        key_rows="workbench.protocol.keys:transfer_rows",
        runner="studies.transfer.transfer_study:transfer",
        report="reports.transfer.transfer_build:TRANSFER_REPORT",
        unit="regime",
    ),
    ProtocolKind(
        name="intervention",
        markers=("interventions",),
        command="intervene",
        title="a grid of interventions on trained cells",
        help="Evaluate an intervention protocol: every head, branch and patch of every acted-on model, as MLflow child runs.",
        parser="workbench.protocol.intervention:parse_intervention_protocol",
        key_rows="workbench.protocol.keys:intervention_rows",
        runner="studies.interventions.intervene:intervene",
        report="reports.interventions.intervention_report:REPORT",
        unit="intervention",
    ),
    ProtocolKind(
        name="attribution",
        markers=("attribution",),
        command="attribute",
        title="attribution maps scored against exact causal effects",
        help="Score an attribution protocol: every method against exact token-drop effects on every acted-on model, as MLflow child runs.",
        parser="workbench.protocol.attribution:parse_attribution_protocol",
        key_rows="workbench.protocol.keys:attribution_rows",
        runner="studies.attribution.attribute:attribute",
        report="reports.attribution.attribution_report:REPORT",
        unit="method",
    ),
)
KINDS = tuple(k.name for k in PROTOCOL_KINDS)
BY_NAME = {k.name: k for k in PROTOCOL_KINDS}
DEFAULT_KIND = "ablation"  # a file with no kind's marker
# The order markers are tried in: a file with ``interventions`` is an intervention protocol whatever
# else it holds (its parser then names any key that does not belong). A protocol known only by
# name is looked for in the store in the same order, then as the default kind.
DETECTION_ORDER = ("intervention", "attribution", "transfer")
LOOKUP_ORDER = tuple(BY_NAME[name] for name in (*DETECTION_ORDER, DEFAULT_KIND))


def kind_of(data: Any) -> str:
    """The kind of parsed protocol content: the first kind (``DETECTION_ORDER``) one of whose
    markers is a top-level key, else ``ablation``."""
    if isinstance(data, dict):
        for name in DETECTION_ORDER:
            if any(marker in data for marker in BY_NAME[name].markers):
                return name
    return DEFAULT_KIND


def parsers() -> dict[str, Any]:
    """Every kind's parser by kind name, in the table's order (imported on first use)."""
    return {k.name: k.load("parser") for k in PROTOCOL_KINDS}
