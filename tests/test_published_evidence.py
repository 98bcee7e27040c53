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


# Acting studies published whose acted-on cells cannot be shipped yet, and why: each must be
# rebuilt bit for bit on the kind of CPU that trained it (docs/training.md), then attached with
# scripts/attach_rebuilt_weights.py.
WITHOUT_WEIGHTS = {
    "cifar10_registers_faithfulness": (
        "12 bf16 cells of cifar10_registers trained on an Intel Xeon with AMX; its base and "
        "base_reg4 cells ship with cifar10_registers_faithfulness_stratified, the p4_w96 ones "
        "need that kind of CPU"
    ),
}


def test_every_acting_study_ships_the_weights_it_acted_on():
    """Every published attribution or intervention study re-runs offline from the repository
    (``--cells-from`` its evidence): its export ships its acted-on cells, each cell of its records
    in the manifest; only the studies named in ``WITHOUT_WEIGHTS`` are waiting for theirs."""
    import json

    acting = ("workbench-attribution-evidence/1", "workbench-intervention-evidence/1")
    lacking, incomplete = set(), []
    for runs in sorted(RESULTS.glob("*/evidence/runs.json")):
        doc = json.loads(runs.read_text())
        if doc.get("format") not in acting:
            continue
        study, manifest = runs.parent.parent.name, runs.parent / "weights" / "manifest.json"
        if not manifest.is_file():
            lacking.add(study)
            continue
        shipped = {
            (c["arm"], c["seed"], c["source_run_id"])
            for c in json.loads(manifest.read_text())["cells"]
        }
        for cell in doc["cells"]:
            tags = cell["tags"]
            key = (tags["arm"], int(tags["seed"]), tags["source_run_id"])
            if key not in shipped:
                incomplete.append(f"{study}: {key} not in its weights")
    assert lacking == set(WITHOUT_WEIGHTS), (
        f"without weights: {sorted(lacking)}; expected {sorted(WITHOUT_WEIGHTS)}"
    )
    assert not incomplete, incomplete
