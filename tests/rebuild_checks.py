"""Checks for a report rebuilt from its evidence: no store opened, every number at its place.

``numbers_by_place``: every number of a Markdown report, by place. A place is a table cell (section headings, table number in the section, row number, column
header) or a section's running text (all its numbers in order). Comparing places rather than
the whole text lets a published report be checked against a rebuild by newer report code that
added a column or a sentence elsewhere: every number the published page shows must be shown
again, at the same place, with the same digits.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from reports import document, results, tables
from reports.evidence import load_evidence
from reports.interventions import intervention_evidence
from reports.provenance import REBUILT_PREFIX
from reports.render import Figure, to_markdown
from tracking.record import queries

NUMBER = re.compile(r"[+−-]?\d[\d,]*(?:\.\d+)?")


def without_rebuilt_line(md: str) -> str:
    """The report without the one line a rebuild from evidence adds (documented in docs/reports.md)."""
    return "\n".join(line for line in md.split("\n") if not line.startswith(f"- {REBUILT_PREFIX}"))


def numbers_by_place(md: str) -> dict[tuple, list[str]]:
    out: dict[tuple, list[str]] = {}
    headings: list[str] = []
    header: list[str] | None = None
    table, row = 0, 0
    for line in without_rebuilt_line(md).split("\n"):
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            headings = headings[: level - 1] + [line.lstrip("#").strip()]
            header, table = None, 0
            continue
        section = " / ".join(headings)
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header, table, row = cells, table + 1, 0
            elif not set(line) <= set("|:- "):
                row += 1
                for column, cell in zip(header, cells):
                    out[(section, table, row, column)] = NUMBER.findall(cell)
            continue
        header = None
        out.setdefault((section, "text"), []).extend(NUMBER.findall(line))
    return out


def number_differences(published: str, rebuilt: str) -> tuple[int, list[str]]:
    """(numbers compared, differences): every place of ``published`` against the same place of ``rebuilt``."""
    a, b = numbers_by_place(published), numbers_by_place(rebuilt)
    compared, diffs = 0, []
    for place, numbers in a.items():
        compared += len(numbers)
        if place not in b:
            diffs.append(f"{place}: {numbers} published, place absent from the rebuild")
        elif b[place] != numbers:
            diffs.append(f"{place}: published {numbers}, rebuilt {b[place]}")
    return compared, diffs


@contextmanager
def store_in(root: Path, empty_mlflow_db: Path) -> Iterator[str]:
    """A copy of the empty store at ``root/mlflow.db``, configured by absolute path (as
    ``sqlite:///$PWD/...`` gives it), with the working directory at ``root``: conftest's
    ``mlflow_store`` for a fixture built once per module."""
    import mlflow

    shutil.copyfile(empty_mlflow_db, root / "mlflow.db")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.delenv("MLFLOW_RUN_ID", raising=False)
        patch.chdir(root)
        mlflow.set_tracking_uri(uri)
        yield uri


def forbid_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No MLflow store from here on: the configured one does not exist and any query fails the test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'absent.db'}")

    def no_store(*args, **kwargs):
        raise AssertionError("the rebuild from evidence opened the MLflow store")

    for name in (
        "configure_tracking",
        "MlflowClient",
        "search_runs",
        "download_artifact",
        "metric_history",
        "parent_runs",
        "analysis_figures",
    ):
        monkeypatch.setattr(queries, name, no_store)


def accuracy_differences(folder: Path) -> tuple[int, list[str]]:
    """(table places checked, differences): the Accuracy tables of ``folder/report.md`` against the
    same tables rendered from ``folder/evidence`` alone (no bootstrap: fast). Also fails on an export
    that is damaged (sha256) or whose logged accuracies differ from its predictions."""
    study = load_evidence(folder / "evidence").study
    assert tables.consistency_problems(study) == [], (
        "logged accuracy differs from the exported predictions"
    )
    summaries = {
        split: [tables.arm_summary(study, arm, split) for arm in study.spec.arms]
        for split in study.spec.splits
    }
    decimals = {split: results.display_decimals(rows) for split, rows in summaries.items()}
    blocks = [
        b
        for b in document.accuracy_section(study, summaries, decimals)
        if not isinstance(b, Figure)
    ]
    expected = {k: v for k, v in numbers_by_place(to_markdown(blocks)).items() if k[1] != "text"}
    text = (folder / "report.md").read_text()
    published = numbers_by_place(
        "## Accuracy" + text.split("\n## Accuracy", 1)[1].split("\n## ", 1)[0]
    )
    return len(expected), [
        f"{place}: report {published.get(place)}, evidence {numbers}"
        for place, numbers in expected.items()
        if published.get(place) != numbers
    ]


def intervention_accuracy_differences(
    folder: Path, tolerance: float = 1e-9
) -> tuple[int, list[str]]:
    """(values checked, differences) of an intervention export: every reported cell's logged
    ``intact_accuracy`` and ``accuracy/<name>`` against the accuracy its exported outcomes give
    (within ``tolerance``), and the intact accuracies ``folder/report.md`` prints per arm against
    the same outcomes (to half a unit of the last printed decimal). Also fails on an export that is
    damaged (sha256) or whose protocol no longer hashes to the recorded hash."""
    study = intervention_evidence.load_evidence(folder / "evidence").study
    text = (folder / "report.md").read_text()
    checked, diffs = 0, []
    for arm in study.protocol.arms:
        cells = [
            (seed, study.cells[(arm, seed)])
            for seed in study.protocol.seeds
            if (arm, seed) in study.cells
        ]
        for seed, cell in cells:
            logged = cell.record.metrics
            expected = {"intact_accuracy": (cell.intact_predicted == cell.labels).mean()}
            expected |= {
                f"accuracy/{n}": (cell.predicted[k] == cell.labels).mean()
                for k, n in enumerate(cell.names)
            }
            for key, value in expected.items():
                checked += 1
                if key not in logged or abs(logged[key] - value) > tolerance:
                    diffs.append(
                        f"{arm}/seed{seed} {key}: logged {logged.get(key)}, outcomes give {value}"
                    )
        line = next((x for x in text.split("\n") if x.startswith(f"**{arm}**: intact ")), "")
        shown = NUMBER.findall(line.split("accuracy", 1)[-1].split("%", 1)[0])
        for (seed, cell), number in zip(cells, shown):
            checked += 1
            value = 100 * (cell.intact_predicted == cell.labels).mean()
            if abs(float(number) - value) > 0.5 * 10 ** -len(number.partition(".")[2]):
                diffs.append(
                    f"{arm}/seed{seed}: report.md shows intact accuracy {number}, outcomes give {value}"
                )
        if len(shown) != len(cells):
            diffs.append(
                f"{arm}: report.md shows {len(shown)} intact accuracies, the export has {len(cells)} cells"
            )
    return checked, diffs


def attribution_differences(folder: Path, tolerance: float = 1e-9) -> tuple[int, list[str]]:
    """(values checked, differences) of an attribution export: each reported cell's logged
    ``rho/<m>``, ``deletion_auc/<m>`` and ``insertion_auc/<m>`` against what its exported per-image
    arrays give (within ``tolerance``), and the Faithfulness table of ``folder/report.md`` (means and
    t-intervals over seeds, no bootstrap: fast) against the table rendered from the arrays alone.
    Also fails on an export that is damaged (sha256) or whose protocol no longer hashes to the
    recorded hash (``attribution_evidence.load_evidence``)."""
    from reports.attribution import attribution_evidence
    from reports.attribution.attribution_report import faithfulness_table
    from reports.attribution.faithfulness import MEASURES, faithfulness_rows, per_image, seed_value

    study = attribution_evidence.load_evidence(folder / "evidence").study
    confidence = study.protocol.evaluation.confidence
    text = (folder / "report.md").read_text()
    # the page's "# Report: ..." heading: every section's place starts with it
    title = text.split("\n", 1)[0]
    published = numbers_by_place(text)
    checked, diffs = 0, []
    for arm in study.protocol.arms:
        cells = {
            seed: study.cells[(arm, seed)]
            for seed in study.protocol.seeds
            if (arm, seed) in study.cells
        }
        for seed, cell in cells.items():
            for method in cell.methods:
                for measure in MEASURES:
                    key, value = f"{measure}/{method}", seed_value(per_image(cell, method, measure))
                    logged = cell.record.metrics.get(key)
                    checked += 1
                    if logged is None or abs(logged - value) > tolerance:
                        diffs.append(
                            f"{arm}/seed{seed} {key}: logged {logged}, arrays give {value}"
                        )
        rows = faithfulness_rows(cells, n_resamples=10, confidence=confidence, seed=0)
        table = to_markdown([faithfulness_table(rows, confidence)])
        expected = numbers_by_place(f"{title}\n\n## Faithfulness ({arm})\n\n{table}")
        sections = {place[0] for place in expected}
        # Every number the published table shows, at its place; a column that newer report code
        # added (the Fisher-z interval of rho) is in the rebuild only and not compared.
        for place, numbers in published.items():
            if place[0] not in sections or place[1] != 1:
                continue
            checked += 1
            if expected.get(place) != numbers:
                diffs.append(f"{place}: report {numbers}, evidence {expected.get(place)}")
    return checked, diffs


def transfer_differences(folder: Path, tolerance: float = 0.0) -> tuple[int, list[str]]:
    """(values checked, differences) of a transfer export: each reported cell's logged ``test_qwk`` and
    every other ``test_<metric>`` it logged (accuracy, macro-F1, per-class recall, loss) against what its
    exported test predictions give (within ``tolerance``), and the QWK, accuracy and macro-F1 estimates of the "Test metrics per cell" table
    of ``folder/report.md`` and the mean, sd, min and max of its "Over seeds" table against the same
    predictions (no bootstrap: fast). Also fails on an export that is damaged (sha256) or whose
    protocol no longer hashes to the recorded hash (``load_transfer_evidence``)."""
    import io

    import numpy as np

    from reports.transfer.transfer_evidence import load_transfer_evidence
    from reports.content.rounding import fmt
    from workbench.train.evaluate import read_predictions
    from workbench.transfer.evaluate import table_metrics

    data = load_transfer_evidence(folder / "evidence").data
    k = int(data.execution["params"]["transfer.num_classes"])
    regimes = [r.name for r in data.protocol.regimes]
    keys = sorted(
        data.cells,
        key=lambda key: (regimes.index(key[0]) if key[0] in regimes else len(regimes), key[1]),
    )
    values = {
        key: table_metrics(read_predictions(io.BytesIO(data.cells[key].files["test"])), k)
        for key in keys
    }
    checked, diffs = 0, []
    for key in keys:
        logged = data.cells[key].record.metrics
        # test_qwk always; every other test metric the cell logged (a cell of `workbench transfer` logs them all)
        for name in [n for n in values[key] if n == "qwk" or f"test_{n}" in logged and n != "n"]:
            checked += 1
            if (
                f"test_{name}" not in logged
                or abs(logged[f"test_{name}"] - values[key][name]) > tolerance
            ):
                diffs.append(
                    f"{key[0]}/seed{key[1]} test_{name}: logged {logged.get(f'test_{name}')}, "
                    f"predictions give {values[key][name]}"
                )
    places = numbers_by_place((folder / "report.md").read_text())

    def column(section_end: str, name: str) -> list[list[str]]:
        found = sorted(
            (place[2], numbers)
            for place, numbers in places.items()
            if place[1] != "text" and place[0].endswith(section_end) and place[3] == name
        )
        return [numbers for _, numbers in found]

    for label, name in (("QWK", "qwk"), ("accuracy", "accuracy"), ("macro-F1", "macro_f1")):
        shown = column("Test metrics per cell", label)
        # the report's rounding (half up, on the decimal)
        expected = [fmt(values[key][name], 3) for key in keys]
        checked += len(expected)
        if [numbers[:1] for numbers in shown] != [[e] for e in expected]:
            diffs.append(
                f"Test metrics per cell, {label}: report {shown}, predictions give {expected}"
            )
    for label, stat in (
        ("mean QWK", np.mean),
        ("sd", lambda x: np.std(x, ddof=1)),
        ("min", np.min),
        ("max", np.max),
    ):
        expected = []
        for regime in [r for r in regimes if any(key[0] == r for key in keys)]:
            qwk = [values[key]["qwk"] for key in keys if key[0] == regime]
            expected.append(["n/a"] if len(qwk) < 2 and label == "sd" else [f"{stat(qwk):.3f}"])
        shown = [numbers or ["n/a"] for numbers in column("Over seeds", label)]
        checked += len(expected)
        if shown != expected:
            diffs.append(f"Over seeds, {label}: report {shown}, predictions give {expected}")
    return checked, diffs
