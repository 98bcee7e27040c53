"""End to end: a tiny real protocol trained by ``ablate``, then its report from the MLflow store alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_fixtures import make_image_folder
from mlflow.tracking import MlflowClient
from test_ablate import PROTOCOL

from reports import tables
from reports.build import build_report
from studies.ablation.ablate import open_protocol, run_protocol
from studies.runtime.options import StudyOptions


@pytest.mark.slow  # a real ablate run, then its report (about 20 s idle): moved when the default tier passed 5 minutes
def test_report_of_a_real_ablate_run(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    path = tmp_path / "tiny.yaml"
    path.write_text(PROTOCOL.format(name="tiny", epochs=2))
    protocol = open_protocol(str(path), allow_dirty=True)
    outcomes = run_protocol(
        protocol,
        path,
        StudyOptions(
            output_dir=tmp_path / "train", device="cpu", data_path=str(folder), allow_dirty=True
        ),
    )
    assert [o.status for o in outcomes] == ["finished"] * 4, [o.message for o in outcomes]

    result = build_report(str(path), tmp_path / "reports")
    study = result.study
    assert len(study.cells) == 4 and not study.missing and study.spec.splits == ("val", "test")
    client = MlflowClient()
    for outcome in outcomes:  # every per-seed value is the metric of the cell's own run
        run = client.get_run(outcome.run_id)
        arm, seed = run.data.tags["arm"], int(run.data.tags["seed"])
        assert study.cells[(arm, seed)].record.run_id == outcome.run_id
        for split, key in (("val", "best_val_accuracy"), ("test", "test_accuracy")):
            summary = next(s for s in result.summaries[split] if s.arm == arm)
            assert summary.values[seed] == run.data.metrics[key]
        assert len(study.cells[(arm, seed)].curves["val_accuracy"]) == 2
    comparison = result.comparisons["val"][0]
    assert (comparison.a, comparison.b, comparison.paired.n) == ("cnn", "vit", 2)
    assert comparison.bootstrap.estimate == pytest.approx(
        comparison.paired.mean_difference, abs=1e-12
    )

    md = result.markdown.read_text()
    assert "Cells with a finished run: **4 of 4**." in md
    # Provenance from what the real runs logged: data and split fingerprints (16 hex), device, commit.
    run = client.get_run(outcomes[0].run_id)
    for key in ("data.fingerprint", "data.split_fingerprint"):
        value = run.data.params[key]
        assert len(value) >= 16 and f"`{value[:16]}`" in md, key
    assert f"`{run.data.tags['git_commit'][:10]}`" in md and "| cpu " in md
    # Compute cost from the logged per-epoch times: 2 epochs per run, a finite throughput; the MLflow
    # run's whole time (training and everything around it) is longer than its training batches.
    cost = next(line for line in md.splitlines() if line.startswith("| vit ") and " s |" in line)
    cells = [c.strip() for c in cost.strip("|").split("|")]
    assert (
        cells[5] == "2 / 2" and cells[2].endswith(" s") and float(cells[6].replace(",", "")) > 0
    ), cells
    assert float(cells[4].removesuffix(" s")) > float(cells[2].removesuffix(" s")), cells
    assert "From the first reported run's start to the last one's end:" in md
    assert (
        "## Configuration" in md
        and "## Results" in md
        and "> On validation, cnn minus vit is" in md
    )
    assert tables.consistency_problems(study) == [], "logged metrics and prediction files disagree"
    for outcome in outcomes:
        assert f"`{outcome.run_id}`" in md
    (parent,) = {client.get_run(o.run_id).data.tags["mlflow.parentRunId"] for o in outcomes}
    assert result.logged_to == [parent]
    assert {Path(a.path).name for a in client.list_artifacts(parent, "report")} == {
        "report.md",
        "report.html",
        "figures",
    }
