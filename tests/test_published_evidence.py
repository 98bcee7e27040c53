"""Published studies carry their evidence: each rebuilds, offline, to the numbers of its report.md.

For every folder under docs/results/ with an ``evidence/`` export: the export is intact (every
file's sha256, the protocol hash), every reported run's logged accuracy equals the one its
exported predictions give, and the per-seed accuracies the published report prints are those
of the export (default tier, about a second). For an intervention study (format
``workbench-intervention-evidence/1``) the same, per intervention: each cell's logged
``accuracy/<name>`` against its exported outcomes, and the intact accuracies of Results; for an
attribution study (``workbench-attribution-evidence/1``) each cell's logged rho and AUCs against its
exported per-image arrays, and the Faithfulness table rendered from them; for a transfer study
(``workbench-transfer-evidence/1``) every test metric each cell logged (QWK, accuracy, macro-F1, recall) against its
exported test predictions, and the per-cell and over-seeds tables of report.md. The
full rebuild, every number of report.md at its place (bootstraps included: about 10 s for 33
cells), is in the `slow` tier. Studies
published before evidence existed are named in docs/results/README.md, saying why they have none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rebuild_checks import (
    accuracy_differences,
    attribution_differences,
    forbid_store,
    intervention_accuracy_differences,
    number_differences,
    transfer_differences,
)

from reports.build import build_from_evidence
from reports.attribution.attribution_evidence import FORMAT as ATTRIBUTION_FORMAT
from reports.evidence import export_format
from reports.interventions.intervention_evidence import FORMAT as INTERVENTION_FORMAT
from reports.transfer.transfer_evidence import FORMAT as TRANSFER_FORMAT

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
STUDIES = (
    sorted(p for p in RESULTS.iterdir() if (p / "report.md").is_file()) if RESULTS.is_dir() else []
)
WITH_EVIDENCE = [p.name for p in STUDIES if (p / "evidence" / "runs.json").is_file()]
# The README's paragraphs on studies without one: published before exports existed, or of a kind not exported.
NO_EVIDENCE_NOTES = ("published before evidence exports existed", "exports ablation studies only")


def test_every_published_study_has_evidence_or_says_why_not():
    readme = (RESULTS / "README.md").read_text()
    paragraphs = [" ".join(p.split()) for p in readme.split("\n\n")]
    note = " ".join(p for p in paragraphs if any(n in p for n in NO_EVIDENCE_NOTES))
    without = [p.name for p in STUDIES if p.name not in WITH_EVIDENCE]
    unexplained = [name for name in without if f"`{name}`" not in note]
    assert STUDIES and not unexplained, (
        f"published without evidence and not named in the README's note: {unexplained}"
    )
    stale = [name for name in WITH_EVIDENCE if f"`{name}`" in note]
    assert not stale, f"the README says these have no evidence, but they do: {stale}"


@pytest.mark.parametrize("study", WITH_EVIDENCE)
def test_published_evidence_is_intact_and_gives_the_reported_accuracies(
    study, tmp_path, monkeypatch
):
    forbid_store(monkeypatch, tmp_path)
    check = {
        INTERVENTION_FORMAT: intervention_accuracy_differences,
        ATTRIBUTION_FORMAT: attribution_differences,
        TRANSFER_FORMAT: transfer_differences,
    }.get(export_format(RESULTS / study / "evidence"), accuracy_differences)
    checked, diffs = check(RESULTS / study)
    assert checked > 0 and not diffs, diffs[:20]


@pytest.mark.slow
@pytest.mark.parametrize("study", WITH_EVIDENCE)
def test_published_report_rebuilds_from_its_evidence_number_for_number(
    study, tmp_path, monkeypatch
):
    forbid_store(monkeypatch, tmp_path)
    rebuilt = build_from_evidence(RESULTS / study / "evidence", tmp_path)
    compared, diffs = number_differences(
        (RESULTS / study / "report.md").read_text(), rebuilt.markdown.read_text()
    )
    assert compared > 0 and not diffs, f"{len(diffs)} places differ: {diffs[:20]}"


def test_every_shipped_weight_file_is_there_with_its_sha256():
    """A published study's ``weights/manifest.json`` names files that a clone must hold, unchanged
    (``attribute --cells-from`` reads them); a clone without them fails here, not for a reader."""
    import hashlib
    import json

    manifests = sorted(
        Path(__file__).resolve().parents[1].glob("docs/results/*/evidence/weights/manifest.json")
    )
    assert manifests, "no published study ships its acted-on weights"
    problems = []
    for manifest in manifests:
        evidence = manifest.parent.parent
        for cell in json.loads(manifest.read_text())["cells"]:
            for name, digest in cell["files"].items():
                path = evidence / name
                if not path.is_file():
                    problems.append(f"{path}: missing")
                elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                    problems.append(f"{path}: sha256 differs from {manifest}")
    assert not problems, problems
