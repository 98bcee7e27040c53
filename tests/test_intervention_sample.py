"""The intervention kind's scored images (issue 48 [AA] item 1): the evaluated split's and patching's
clean images per class, carried through the evidence to a "Scored images" section that warns on a
thin sample (``--strict`` refuses it); evidence exported before the counts renders without it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from reports.interventions import intervention_evidence, intervention_report
from reports.interventions.evaluated_images import scored_blocks
from reports.render import Heading, Para, Table
from tracking.kinds.intervention_runs import InterventionCellResult
from workbench.protocol import load_intervention_protocol
from workbench.sample import MIN_PER_CLASS, class_counts

ROOT = Path(__file__).resolve().parents[1]
PATCHING = ROOT / "studies" / "protocols" / "fmnist_seed_recipe_patching.yaml"
EVIDENCE = ROOT / "docs" / "results" / "fmnist_seed_recipe_patching" / "evidence"
CLASSES = np.arange(10)


def cell(
    split_labels: np.ndarray | None, clean_labels: np.ndarray | None
) -> InterventionCellResult:
    """A cell with the given evaluated split's labels and patching clean labels (None: not logged)."""
    labels = np.zeros(4, int) if split_labels is None else split_labels
    patching = None
    if clean_labels is not None:
        c = class_counts(clean_labels, CLASSES)
        patching = {
            "clean_label": clean_labels,
            "sample_classes": c.classes,
            "class_counts": c.counts,
        }
    return InterventionCellResult(
        SimpleNamespace(arm="vit", seed=0),
        ["blocks.0.attn.skip"],
        labels,
        labels,
        labels[None, :],
        None,
        "",
        np.arange(len(labels)),
        patching,
        None if split_labels is None else class_counts(split_labels, CLASSES),
    )


def test_a_one_class_patching_sample_is_warned_about_and_given_to_strict():
    protocol = load_intervention_protocol(PATCHING)
    split = np.repeat(CLASSES, 80)  # the whole split: 80 of each class
    cells = {s: cell(split, np.zeros(256, int)) for s in (0, 1)}
    blocks, problems = scored_blocks(protocol, [("vit", cells)])
    assert isinstance(blocks[0], Heading) and blocks[0].text == "Scored images", blocks[0]
    split_table, pairs_table = [b for b in blocks if isinstance(b, Table)]
    assert split_table.rows[0] == ["vit", "0", *["80"] * 10, "800"], split_table.rows
    assert pairs_table.rows[1] == ["vit", "1", "256", *["0"] * 9, "256"], pairs_table.rows
    assert "drawn uniformly (seed 0" in pairs_table.notes[0], pairs_table.notes
    assert problems == [
        "patching pairs: vit: 9 of 10 classes have no scored image (classes 1, 2, 3, 4, 5, 6, 7, 8 "
        "and 1 more): the scored images do not speak for every class of the data"
    ], problems
    warning = [b.text for b in blocks if isinstance(b, Para)]
    assert (
        warning
        and warning[0].startswith("⚠ patching pairs: vit: 9 of 10")
        and "--strict" in warning[0]
    )
    # a stratified sample of the same size: every class has its share, nothing to warn or refuse
    even = np.repeat(CLASSES, MIN_PER_CLASS + 15)
    blocks, problems = scored_blocks(protocol, [("vit", {0: cell(split, even)})])
    assert not problems and not any(isinstance(b, Para) for b in blocks), problems


def test_a_thin_evaluated_split_is_warned_about():
    protocol = load_intervention_protocol(PATCHING)
    split = np.concatenate([np.repeat(CLASSES[:9], 30), np.full(4, 9)])
    _, problems = scored_blocks(protocol, [("vit", {0: cell(split, None)})])
    assert problems == [
        f"vit: 1 class has fewer than {MIN_PER_CLASS} scored images (9: 4): the scored images do "
        "not speak for every class of the data"
    ], problems


def test_published_evidence_without_counts_has_no_scored_images_section():
    study = intervention_evidence.load_evidence(EVIDENCE).study
    arms: dict[str, dict] = {}
    for (arm, seed), c in study.cells.items():
        if (arm, seed) in study.chosen:
            arms.setdefault(arm, {})[seed] = c
    assert arms and all(c.counts is None for cells in arms.values() for c in cells.values())
    assert all("class_counts" not in c.patching for cells in arms.values() for c in cells.values())
    assert scored_blocks(study.protocol, list(arms.items())) == ([], [])


def test_the_counts_travel_through_the_evidence_export(tmp_path):
    split = np.repeat(CLASSES, 3)
    original = cell(split, np.repeat(CLASSES, 2))
    entry: dict = {}
    intervention_evidence._write_cell(tmp_path, entry, original.record, original)
    assert entry["outcomes"]["class_counts"] == {"classes": list(range(10)), "counts": [3] * 10}
    back = intervention_evidence._cell(tmp_path, original.record, entry)
    assert np.array_equal(back.counts.counts, original.counts.counts)
    assert np.array_equal(back.counts.classes, original.counts.classes)
    assert np.array_equal(back.patching["class_counts"], np.full(10, 2))


def test_the_report_gives_a_thin_sample_to_strict_as_a_refusal():
    """The published patching evidence with one-class clean images injected: the report's warnings
    and what ``--strict`` refuses both name it (as they name a missing cell)."""
    exported = intervention_evidence.load_evidence(EVIDENCE)
    study = exported.study
    for key in study.chosen:
        c = study.cells[key]
        c.counts = class_counts(c.labels, CLASSES)
        thin = class_counts(np.zeros(256, int), CLASSES)
        c.patching = {**c.patching, "sample_classes": thin.classes, "class_counts": thin.counts}
    blocks, warnings, refused, _, _ = intervention_report.build_blocks(
        study, exported.inputs, [], 200
    )
    said = [w for w in refused if w.startswith("sample: patching pairs: vit: 9 of 10 classes")]
    assert said and said[0] in warnings, refused
    assert any(isinstance(b, Heading) and b.text == "Scored images" for b in blocks)
