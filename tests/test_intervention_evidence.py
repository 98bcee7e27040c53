"""Intervention evidence: a report rebuilt from the export, without the MLflow store, is the same report.

The study is ``intervention_store``'s (3 seeds of one ViT arm, known effects, attention maps),
plus a newer KILLED attempt of one cell that the report lists but does not use.
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import pytest
from intervention_store import log_intervention_store
from mlflow.tracking import MlflowClient
from rebuild_checks import forbid_store, number_differences, store_in, without_rebuilt_line

from reports.build import build_from_evidence, build_report
from reports.collect import ReportError
from reports.interventions.intervention_evidence import FORMAT


# a real MLflow store (conftest marks tests by fixture name; this one is shared)
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def exported(tmp_path_factory, empty_mlflow_db) -> dict:
    """The study's report built from its store with --evidence, once for this module (a copied
    store, cwd beside it, as conftest's ``mlflow_store`` does per test)."""
    root = tmp_path_factory.mktemp("intervention_evidence")
    with store_in(root, empty_mlflow_db):
        logged = log_intervention_store(root)
        client = MlflowClient()
        exp_id = client.get_run(logged["parent"]).info.experiment_id
        time.sleep(0.01)  # starts after the reported run of vit/seed1
        tags = {
            "cell": "true",
            "intervention": "true",
            "protocol_name": "tiny_logged",
            "arm": "vit",
            "seed": "1",
            "protocol_hash": logged["protocol"].hash,
            "mlflow.parentRunId": logged["parent"],
            "note": f"token=hunter2 in {root}/outputs",
        }
        killed = client.create_run(exp_id, tags=tags).info.run_id
        client.set_terminated(killed, "KILLED")
        result = build_report(str(logged["path"]), root / "out", n_resamples=300, evidence=True)
        yield {
            **logged,
            "root": root,
            "result": result,
            "killed": killed,
            "evidence": result.folder / "evidence",
        }


def _copy(exported: dict, tmp_path: Path) -> Path:
    """A copy of the export to damage, beside a copy of its report folder."""
    folder = tmp_path / "copy" / "tiny_logged"
    shutil.copytree(exported["result"].folder, folder)
    return folder / "evidence"


def test_report_rebuilt_from_intervention_evidence_is_the_same(exported, tmp_path, monkeypatch):
    evidence, published = exported["evidence"], exported["result"]
    doc = json.loads((evidence / "runs.json").read_text())
    assert (
        doc["format"] == FORMAT
        and len(doc["cells"]) == 4
        and doc["build"]["logged_to"] == [exported["parent"]]
    )
    text = (evidence / "runs.json").read_text()
    assert "hunter2" not in text and str(exported["root"]) not in text, (
        "a secret or an absolute path was exported"
    )
    forbid_store(monkeypatch, tmp_path)
    rebuilt = build_from_evidence(evidence, tmp_path / "rebuilt")
    a, b = published.markdown.read_text(), rebuilt.markdown.read_text()
    compared, diffs = number_differences(a, b)
    assert compared > 100 and not diffs, f"{len(diffs)} places differ: {diffs[:10]}"
    assert (
        without_rebuilt_line(b) == a
        and b.count("Rebuilt offline from the evidence export `tiny_logged/evidence`") == 1
    )
    # the newer attempt and the effects are there to compare
    assert exported["killed"] in a and "-13.33" in a
    assert (
        sorted(p.name for p in rebuilt.figures)
        == sorted(p.name for p in published.figures)
        == ["attention_vit.png", "branches_vit.png", "heads_vit.png"]
    )
    different = [
        p.name
        for p, q in zip(sorted(published.figures), sorted(rebuilt.figures))
        if p.read_bytes() != q.read_bytes()
    ]
    assert not different, f"figures differ: {different}"


def test_a_tampered_outcome_file_is_refused_in_one_line_naming_it(exported, tmp_path):
    evidence = _copy(exported, tmp_path)
    path = evidence / "outcomes" / "vit.seed2.csv.gz"
    text = gzip.decompress(path.read_bytes()).decode()
    lines = text.split("\n")
    # one example's outcome changed
    lines[1] = lines[1][:-1] + ("1" if lines[1][-1] != "1" else "0")
    path.write_bytes(gzip.compress("\n".join(lines).encode(), mtime=0))
    with pytest.raises(ReportError) as err:
        build_from_evidence(evidence, tmp_path / "rebuilt")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "sha256 differs" in message, message


def test_an_exported_protocol_that_no_longer_hashes_is_refused(exported, tmp_path):
    evidence = _copy(exported, tmp_path)
    runs = evidence / "runs.json"
    doc = json.loads(runs.read_text())
    doc["protocol"]["files"]["tiny_logged.yaml"] += "evaluation: {confidence: 0.9}\n"
    runs.write_text(json.dumps(doc))
    with pytest.raises(
        ReportError, match=r"runs.json: the exported protocol file hashes to [0-9a-f]{12}, not"
    ):
        build_from_evidence(evidence, tmp_path / "rebuilt")
