"""The one table of protocol kinds feeds every place that tells kinds apart."""

from __future__ import annotations

import pytest

import click

from studies.cli import LAZY_COMMANDS, main as cli
from tracking.record.queries import protocol_kind
from workbench.kinds import BY_NAME, DEFAULT_KIND, KINDS, PROTOCOL_KINDS, parsers
from workbench.protocol import kind_of
from workbench.protocol.keys import TITLES, key_rows


class _Parent:
    """A study parent run as protocol_kind reads it: its tags."""

    def __init__(self, tags: dict[str, str]) -> None:
        self.data = type("Data", (), {"tags": tags})()


def test_every_kind_has_a_parser_keys_a_report_and_a_command():
    assert tuple(parsers()) == KINDS
    formats = set()
    for kind in PROTOCOL_KINDS:
        assert callable(kind.load("parser")), kind.name
        assert kind.command in LAZY_COMMANDS, f"{kind.name}: no command {kind.command!r}"
        runner = kind.load("runner")
        assert isinstance(runner, click.Command) and runner.name == kind.command, kind.name
        assert cli.get_command(click.Context(cli), kind.command).callback is not None
        assert key_rows(kind.name), f"{kind.name}: no keys in the reference"
        assert TITLES[kind.name].startswith(f"{kind.name.capitalize()} protocol (`workbench ")
        report = kind.load("report")
        for answer in ("build", "by_name", "rebuild"):
            assert callable(getattr(report, answer, None)), f"{kind.name}: report lacks {answer}"
        formats.add(report.evidence_format)
    assert len(formats) == len(KINDS), "two kinds' evidence exports declare the same format"


def test_a_bad_path_in_the_table_is_named_when_loaded():
    from workbench.kinds import load_path

    with pytest.raises(ModuleNotFoundError, match="workbench.nope"):
        load_path("workbench.nope:thing")
    with pytest.raises(AttributeError, match="no_such_parser"):
        load_path("workbench.protocol.ablation:no_such_parser")


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
