"""The study runtime: one outcome type with a closed vocabulary, one tally line, one driver for every kind.

A new study kind is one module implementing ``StudyKind``: ``CountingStudy`` below is one (a
protocol file of its own, cells that each log one number in a leased child run), and the driver
gives it the study's one parent, the per-cell lines, the tally and the rerun that skips.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.runtime.cell_end import end_cell, hold_opened, outcome_of_error
from studies.cli import main
from studies.runtime.options import StudyOptions, study_options
from studies.runtime.outcome import CellOutcome, Status, tally, tally_line
from studies.runtime.study_kind import StudyKind, open_study, run_study
from tracking.record.cell_runs import open_leased_run
from tracking.record.schema import CELL, PROTOCOL_HASH, PROTOCOL_NAME, RUN_NAME, TRUE


def test_an_outcome_with_a_status_outside_the_vocabulary_is_refused():
    with pytest.raises(
        ValueError, match=r"'done': not one of finished, skipped, failed, busy, lost, stopped"
    ):
        CellOutcome(None, "done", "x")
    outcome = CellOutcome(None, "finished", "x")  # a known word is the enum member
    assert (
        outcome.status is Status.FINISHED
        and outcome.status == "finished"
        and f"{outcome.status}" == "finished"
    )


def test_the_one_tally_line_names_what_occurred():
    outcomes = [CellOutcome(None, s, "m") for s in ("finished", "finished", "skipped", "failed")]
    assert tally_line(tally(outcomes)) == "cells: 2 run, 1 already finished (skipped), 1 failed"
    outcomes += [CellOutcome(None, s, "m") for s in ("busy", "lost", "stopped")]
    assert tally_line(tally(outcomes)) == (
        "cells: 2 run, 1 already finished (skipped), 1 failed, 1 held by another "
        "live execution (not touched), 1 taken over by another execution, "
        "1 stopped by an observer"
    )


def test_a_study_commands_options_arrive_as_one_object():
    got = []

    @click.command()
    @click.option("--protocol")
    @study_options("outputs/counts", "Where the counts go.")
    def counts(protocol, options):
        got.append((protocol, options))

    result = CliRunner().invoke(
        counts,
        [
            "--protocol",
            "p.yaml",
            "--device",
            "cpu",
            "--data-path",
            "d",
            "--allow-dirty",
            "--download",
            "--output-dir",
            "o",
            "--threads",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    assert got == [
        (
            "p.yaml",
            StudyOptions(
                output_dir=Path("o"),
                device="cpu",
                data_path="d",
                allow_dirty=True,
                download=True,
                threads=0,
            ),
        )
    ]
    assert CliRunner().invoke(counts, []).exit_code == 0 and got[-1][1] == StudyOptions(
        output_dir=Path("outputs/counts")
    )


@pytest.mark.parametrize(
    "command, default, words",
    [
        ("ablate", "outputs/ablate", "Checkpoints and predictions"),
        ("transfer", "outputs/transfer", "downloaded sources"),
        ("intervene", "outputs/intervene", "Downloaded checkpoints"),
        ("attribute", "outputs/attribute", "Downloaded checkpoints"),
    ],
)
def test_each_study_command_keeps_its_own_output_folder_and_help(command, default, words):
    text = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
    for option in (
        "--allow-dirty",
        "--device",
        "--data-path",
        "--download / --no-download",
        "--threads",
    ):
        assert option in text, (option, text)
    assert f"{words}" in text and f"[default: {default}]" in text, text


@dataclass(frozen=True)
class CountCell:
    number: int

    @property
    def key(self) -> str:
        return f"n{self.number}"


@dataclass(frozen=True)
class CountProtocol:
    name: str
    numbers: tuple[int, ...]
    description: str = "counts"

    def canonical_json(self) -> str:
        return json.dumps({"name": self.name, "numbers": list(self.numbers)}, sort_keys=True)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @property
    def short_hash(self) -> str:
        return self.hash[:12]

    def cells(self) -> list[CountCell]:
        return [CountCell(n) for n in self.numbers]


class CountingStudy(StudyKind):
    """A whole study kind: each cell logs its number squared in its own leased child run."""

    def __init__(self) -> None:
        self.ran: list[int] = []

    @classmethod
    def load(cls, path: str) -> CountProtocol:
        data = yaml.safe_load(Path(path).read_text())
        return CountProtocol(data["name"], tuple(data["numbers"]))

    def prepare(self, protocol, protocol_file, options) -> str:
        self.protocol = protocol
        return f"{protocol.name}: {len(protocol.numbers)} numbers"

    def run_cell(self, cell: CountCell, parent) -> CellOutcome:
        tags = {
            CELL: TRUE,
            PROTOCOL_NAME: self.protocol.name,
            PROTOCOL_HASH: self.protocol.hash,
            RUN_NAME: cell.key,
        }
        opened = open_leased_run(
            self.protocol.name, f"{self.protocol.hash[:8]}-{cell.key}", tags, parent.run_id
        )
        untouched = hold_opened(cell, opened)
        if untouched is not None:
            return untouched
        token = opened.token
        try:
            if cell.number < 0:
                raise ValueError(f"{cell.number} is negative")
            opened.sink.log_metrics({"square": cell.number**2})
            end_cell(opened.sink, token, "FINISHED")
        except BaseException as err:  # noqa: BLE001 - the one end of a cell that failed
            return outcome_of_error(cell, opened.sink, token, err)
        self.ran.append(cell.number)
        return CellOutcome(
            cell, Status.FINISHED, f"{cell.key}: {cell.number**2}", opened.sink.run_id
        )


def test_a_new_kind_is_one_class_run_by_the_driver_with_one_parent_and_a_rerun_that_skips(
    mlflow_store, tmp_path, capsys
):
    path = tmp_path / "counts.yaml"
    path.write_text("name: counts\nnumbers: [2, 3]\n")
    options = StudyOptions(output_dir=tmp_path / "out", allow_dirty=True)
    protocol = open_study(CountingStudy, str(path), allow_dirty=True)
    first = CountingStudy()
    outcomes = run_study(first, protocol, path, options)
    assert [o.status for o in outcomes] == ["finished", "finished"] and first.ran == [2, 3]
    out = capsys.readouterr().out
    assert (
        "[finished] n2: 4" in out and "cells: 2 run, 0 already finished (skipped), 0 failed" in out
    ), out

    again = CountingStudy()
    assert [o.status for o in run_study(again, protocol, path, options)] == [
        "skipped",
        "skipped",
    ] and again.ran == []
    assert "cells: 0 run, 2 already finished (skipped), 0 failed" in capsys.readouterr().out

    client = MlflowClient()
    exp = client.get_experiment_by_name("counts").experiment_id
    (parent,) = client.search_runs([exp], "tags.parent = 'true'")
    cells = client.search_runs([exp], "tags.cell = 'true'")
    assert parent.info.status == "FINISHED" and len(cells) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in cells} == {parent.info.run_id}
    assert sorted(c.data.metrics["square"] for c in cells) == [4.0, 9.0]


def test_a_failing_cell_of_any_kind_ends_failed_and_the_study_exits_1(
    mlflow_store, tmp_path, capsys
):
    path = tmp_path / "counts.yaml"
    path.write_text("name: signs\nnumbers: [-1, 5]\n")
    protocol = open_study(CountingStudy, str(path), allow_dirty=True)
    kind = CountingStudy()
    with pytest.raises(SystemExit) as exited:
        run_study(kind, protocol, path, StudyOptions(output_dir=tmp_path / "out", allow_dirty=True))
    assert exited.value.code == 1 and kind.ran == [5]  # the failing cell took no other down
    captured = capsys.readouterr()
    assert "cells: 1 run, 0 already finished (skipped), 1 failed" in captured.out
    assert "FAILED n-1: ValueError: -1 is negative" in captured.err
    client = MlflowClient()
    exp = client.get_experiment_by_name("signs").experiment_id
    (failed,) = client.search_runs([exp], "tags.cell = 'true' and attributes.status = 'FAILED'")
    assert failed.data.tags["failure"] == "ValueError: -1 is negative"
    (parent,) = client.search_runs([exp], "tags.parent = 'true'")
    assert parent.info.status == "FAILED"
