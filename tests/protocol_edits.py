"""Schema tests of the protocols that act on trained models (attribution, interventions): a base
protocol, as parsed YAML, edited, parsed as a file beside the shipped protocols, and refused in
one line that names that file.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest

from workbench.protocol import ProtocolError, load_protocol

PROTOCOLS = Path(__file__).resolve().parents[1] / "studies" / "protocols"
SMOKE_HASH = load_protocol(PROTOCOLS / "smoke.yaml").hash  # what the base protocols act on


def on_smoke(name: str, description: str, **section) -> dict:
    """A protocol (as parsed YAML) acting on the smoke protocol's cells, pinned by hash."""
    return {
        "name": name,
        "description": description,
        "acts_on": {"protocol": "smoke", "hash": SMOKE_HASH},
        **section,
    }


class EditedProtocol:
    """``base`` (its ``name`` names the file, so a pinned ``acts_on`` is read beside it) parsed by
    ``parse`` after an edit."""

    def __init__(self, base: dict, parse: Callable) -> None:
        self.base, self.parse = base, parse
        self.source = str(PROTOCOLS / f"{base['name']}.yaml")

    def parsed(self, edit=lambda d: None):
        """The protocol parsed from a deep copy of the base that ``edit`` changed in place."""
        data = copy.deepcopy(self.base)
        edit(data)
        return self.parse(data, source=self.source)

    def error(self, edit) -> str:
        """The message the edited protocol is refused with: one line, starting with its file."""
        with pytest.raises(ProtocolError) as info:
            self.parsed(edit)
        message = str(info.value)
        assert message.startswith(self.source + ": ") and "\n" not in message, message
        return message
