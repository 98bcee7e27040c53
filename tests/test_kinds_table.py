"""The one table of protocol kinds feeds every place that tells kinds apart."""

from __future__ import annotations

import pytest

from reports.build import ACTED_REPORTS, REPORTED_KINDS
from studies.cli import LAZY_COMMANDS
from tracking.record.queries import protocol_kind
from workbench.protocol import PARSERS, kind_of
from workbench.protocol.keys import TITLES, key_rows
from workbench.protocol.kinds import BY_NAME, DEFAULT_KIND, KINDS, PROTOCOL_KINDS


class _Parent:
    """A study parent run as protocol_kind reads it: its tags."""

    def __init__(self, tags: dict[str, str]) -> None:
        self.data = type("Data", (), {"tags": tags})()


def test_every_kind_has_a_parser_keys_a_report_and_a_command():
    assert tuple(PARSERS) == KINDS
    assert sorted(REPORTED_KINDS) == sorted(KINDS)
    assert set(ACTED_REPORTS) <= set(KINDS)
    for kind in PROTOCOL_KINDS:
        assert kind.command in LAZY_COMMANDS, f"{kind.name}: no command {kind.command!r}"
        assert key_rows(kind.name), f"{kind.name}: no keys in the reference"
        assert TITLES[kind.name].startswith(f"{kind.name.capitalize()} protocol (`workbench ")


@pytest.mark.parametrize("kind", [k for k in KINDS if k != DEFAULT_KIND])
def test_a_marker_makes_its_kind_and_a_parent_tag_names_it(kind):
    for marker in BY_NAME[kind].markers:
        assert kind_of({"name": "x", marker: {}}) == kind
    assert protocol_kind(_Parent({kind: "true", "parent": "true"})) == kind


def test_no_marker_is_an_ablation_protocol_and_markers_keep_their_order():
    assert kind_of({"name": "x", "arms": []}) == "ablation"
    assert kind_of(["not", "a", "mapping"]) == "ablation"
    assert protocol_kind(_Parent({"parent": "true"})) == "ablation"
    # a file with two kinds' markers is the earlier kind's (its parser then names the stray key)
    assert kind_of({"interventions": {}, "attribution": {}, "source": {}}) == "intervention"
    assert kind_of({"attribution": {}, "regimes": []}) == "attribution"


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown protocol kind 'nope'; one of ablation"):
        key_rows("nope")
