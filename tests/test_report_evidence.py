"""Evidence export: a report rebuilt from it, without the MLflow store, shows every number the same.

The study is made of real runs in a real SQLite store (``test_report.make_store``: hand-made
predictions, no training) with what a report must carry over from the store: a superseded
run, a newer KILLED attempt, a missing cell with a FAILED run, analysis figures on the parent,
an extra ``--compare``, and a store given by absolute path.
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient
from rebuild_checks import (
    accuracy_differences,
    forbid_store,
    number_differences,
    store_in,
    without_rebuilt_line,
)
from test_report import COMMIT_B, VAL_CORRECT, TEST_CORRECT, log_cell, make_store

from reports import document
from reports.build import build_from_evidence, build_report
from reports.collect import ReportError
from reports.evidence import load_evidence
from reports.provenance import REBUILT_PREFIX
from reports.render import to_markdown
from studies.tools.report import report as report_command

PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
)


def rich_study(tmp_path: Path):
    """make_store's 3 arms x 3 seeds minus wide/seed2, plus what only the store knows about."""
    store = make_store(tmp_path, skip=(("wide", 2),))
    client, parent = MlflowClient(), store.parents[0]
    # An older finished run of vit/seed0 from another commit: superseded by the newer one.
    log_cell(
        client,
        store.protocol,
        parent,
        "vit",
        0,
        6,
        4,
        commit=COMMIT_B,
        end_time=int(time.time() * 1000) - 60_000,
    )
    time.sleep(0.01)
    # a newer attempt, never used
    log_cell(client, store.protocol, parent, "cnn", 1, 7, 4, status="KILLED")
    # the missing cell's only run
    log_cell(client, store.protocol, parent, "wide", 2, 9, 5, status="FAILED")
    figures = tmp_path / "logged_figures"
    figures.mkdir()
    (figures / "01_patches.png").write_bytes(PNG)
    (figures / "figures.json").write_text(
        json.dumps(
            {
                "figures": {
                    "01_patches.png": {
                        "caption": f"patch grid of the images in {tmp_path / 'images'}"
                    }
                }
            }
        )
    )
    for name in ("01_patches.png", "figures.json"):
        client.log_artifact(parent, str(figures / name), artifact_path="figures")
    return store


# a real MLflow store (conftest marks tests by fixture name; this one is shared)
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def published(tmp_path_factory, empty_mlflow_db):
    """The study's report built from its store with --evidence, as a study is published; built once
    for this module (as conftest's ``mlflow_store`` does per test: a copied store, cwd beside it)."""
    root = tmp_path_factory.mktemp("published")
    with store_in(root, empty_mlflow_db):
        store = rich_study(root)
        result = build_report(
            str(store.protocol_path),
            root / "docs",
            compare=[("cnn", "wide")],
            n_resamples=200,
            evidence=True,
        )
        yield root, store, result


def test_a_report_rebuilt_from_its_evidence_is_the_same_report(published, tmp_path, monkeypatch):
    root, store, result = published
    evidence = result.folder / "evidence"
    md = result.markdown.read_text()
    study = result.study
    assert (len(study.cells), len(study.superseded), len(study.attempts), len(study.missing)) == (
        8,
        1,
        1,
        1,
    )
    assert (
        "## Analysis figures" in md
        and f"logged as an artifact (`report/`) of run(s) `{store.parents[0]}`" in md
    )
    # The store was given by absolute path; the page names it relative to where the report was built.
    assert str(root) not in md and "Tracking store `sqlite:///mlflow.db`" in md

    forbid_store(monkeypatch, tmp_path)
    rebuilt = build_from_evidence(evidence, tmp_path / "rebuilt")
    assert not (tmp_path / "absent.db").exists()
    rebuilt_md = rebuilt.markdown.read_text()
    added = [line for line in rebuilt_md.split("\n") if line.startswith(f"- {REBUILT_PREFIX}")]
    assert len(added) == 1 and "`study/evidence`" in added[0], added
    assert without_rebuilt_line(rebuilt_md) == md, "the Markdown differs beyond the documented line"
    compared, diffs = number_differences(md, rebuilt_md)
    assert compared > 500 and not diffs, diffs[:20]
    # the published-evidence check, on this study
    checked, diffs = accuracy_differences(result.folder)
    # 2 splits x 3 arms x 9 columns
    assert checked == 2 * 3 * 9 and not diffs, (
        checked,
        diffs[:20],
    )
    html, rebuilt_html = result.html.read_text(), rebuilt.html.read_text()
    assert [line for line in rebuilt_html.split("\n") if REBUILT_PREFIX not in line] == html.split(
        "\n"
    )
    assert sorted(p.name for p in rebuilt.figures) == sorted(p.name for p in result.figures)
    for path in (
        result.figures
    ):  # recomputed figures (forest, seeds, confusion, curves) and the analysis figure
        assert (rebuilt.folder / "figures" / path.name).read_bytes() == path.read_bytes(), path.name
    # The same numbers behind the tables, not just the same text.
    for split in ("val", "test"):
        for a, b in zip(result.summaries[split], rebuilt.summaries[split]):
            assert a.values == b.values, (split, a.arm)
        for a, b in zip(result.comparisons[split], rebuilt.comparisons[split]):
            assert (a.a, a.b, a.paired.mean_difference, a.bootstrap.low, a.bootstrap.high) == (
                b.a,
                b.b,
                b.paired.mean_difference,
                b.bootstrap.low,
                b.bootstrap.high,
            ), (split, a.a, a.b)


def test_the_export_is_complete_deterministic_and_portable(published, tmp_path):
    root, store, result = published
    evidence = result.folder / "evidence"
    doc = json.loads((evidence / "runs.json").read_text())
    assert (
        doc["format"] == "workbench-evidence/1" and doc["protocol"]["hash"] == store.protocol.hash
    )
    assert doc["build"]["compare"] == [["cnn", "wide"]] and doc["build"]["resamples"] == 200
    assert (
        doc["parent_run_id"] == store.parents[0] and doc["parents"][0]["run_id"] == store.parents[0]
    )
    assert len(doc["cells"]) == 11  # 8 reported, 1 superseded, 1 KILLED, 1 FAILED
    statuses = sorted(c["status"] for c in doc["cells"])
    assert statuses == ["FAILED"] + ["FINISHED"] * 9 + ["KILLED"]
    reported = [c for c in doc["cells"] if "predictions" in c]
    assert len(reported) == 8 and all(set(c["predictions"]) == {"val", "test"} for c in reported)
    vit0 = next(c for c in reported if c["tags"]["arm"] == "vit" and c["tags"]["seed"] == "0")
    assert vit0["run_id"] == store.cells[("vit", 0)]
    logged = MlflowClient().get_metric_history(vit0["run_id"], "val_accuracy")
    assert vit0["metric_history"]["val_accuracy"] == [
        [m.step, m.timestamp, m.value] for m in logged
    ]
    assert [row[0] for row in vit0["metric_history"]["val_accuracy"]] == [1, 2, 3]
    info = vit0["predictions"]["val"]
    rows = gzip.decompress((evidence / info["file"]).read_bytes()).decode().split("\n")
    assert rows[0] == "index,label,predicted" and len(rows) == 1 + 10 + 1 and info["classes"] == 3
    correct = sum(int(r.split(",")[1]) == int(r.split(",")[2]) for r in rows[1:-1])
    assert correct == VAL_CORRECT["vit"][0] and TEST_CORRECT["vit"][0] == 5
    # No absolute path of this machine anywhere in the export (the parent's tags held the protocol file's).
    for path in evidence.rglob("*"):
        if path.is_file():
            text = (
                gzip.decompress(path.read_bytes()).decode()
                if path.suffix == ".gz"
                else path.read_text()
            )
            assert str(root) not in text and "/tmp/" not in text, path
    # Deterministic: a second export of the same runs is byte-identical.
    again = build_report(
        str(store.protocol_path),
        root / "again",
        compare=[("cnn", "wide")],
        n_resamples=200,
        log=False,
        evidence=True,
    )
    first = {
        p.relative_to(evidence): p.read_bytes() for p in sorted(evidence.rglob("*")) if p.is_file()
    }
    second = {
        p.relative_to(again.folder / "evidence"): p.read_bytes()
        for p in sorted((again.folder / "evidence").rglob("*"))
        if p.is_file()
    }
    assert first.keys() == second.keys()
    # logged_to: this build did not log
    assert [k for k in first if first[k] != second[k]] == [Path("runs.json")]
    assert json.loads(second[Path("runs.json")])["build"]["logged_to"] == []


def test_damaged_evidence_and_bad_options_are_one_line_errors(published, tmp_path):
    root, _, result = published
    with pytest.raises(ReportError, match="holds the evidence and its published report"):
        # would overwrite the published report
        build_from_evidence(result.folder / "evidence", root / "docs")
    shutil.copytree(result.folder, tmp_path / "study")  # damaged below: a copy
    evidence = tmp_path / "study" / "evidence"
    # A published number edited by hand: both checks name its place.
    md = (tmp_path / "study" / "report.md").read_text()
    row = next(
        line
        for line in md.split("\n")
        if line.startswith("| vit (reference) ") and " 80.00 " in line
    )
    (tmp_path / "study" / "report.md").write_text(
        md.replace(row, row.replace(" 80.00 ", " 80.01 ", 1), 1)
    )
    checked, diffs = accuracy_differences(tmp_path / "study")
    assert len(diffs) == 1 and "'mean'" in diffs[0] and "['80.01']" in diffs[0], diffs
    _, diffs = number_differences((tmp_path / "study" / "report.md").read_text(), md)
    assert len(diffs) == 1 and "80.01" in diffs[0], diffs
    runner = CliRunner()
    out = runner.invoke(
        report_command, ["--from-evidence", str(evidence), "--protocol", "study", "--commit", "a"]
    )
    assert out.exit_code == 2 and "--protocol, --commit: not with --from-evidence" in out.output, (
        out.output
    )
    # Run links come from the export: a study on a tracking server keeps them offline.
    doc = json.loads((evidence / "runs.json").read_text())
    doc["store"]["tracking_uri"] = "https://mlflow.example.org:5000"
    (evidence / "runs.json").write_text(json.dumps(doc))
    study = load_evidence(evidence).study
    runs = to_markdown(document.runs_section(study))
    run = study.cells[("vit", 0)].record
    assert (
        f"[`{run.run_id}`](https://mlflow.example.org:5000/#/experiments/{run.experiment_id}/runs/{run.run_id}?"
        in runs
    )
    damaged = next((evidence / "predictions").glob("cnn.seed0.val.csv.gz"))
    rows = gzip.decompress(damaged.read_bytes()).replace(b"\n0,0,", b"\n0,1,", 1)
    damaged.write_bytes(gzip.compress(rows, mtime=0))
    out = runner.invoke(
        report_command, ["--from-evidence", str(evidence), "--out-dir", str(tmp_path / "x")]
    )
    assert (
        out.exit_code == 1
        and f"{damaged}: sha256 differs" in out.output
        and "Traceback" not in out.output
    ), out.output
    (evidence / "runs.json").write_text("{}")
    out = runner.invoke(
        report_command, ["--from-evidence", str(evidence), "--out-dir", str(tmp_path / "x")]
    )
    assert out.exit_code == 1 and "runs.json: format None" in out.output, out.output
