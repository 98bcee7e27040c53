"""Arm against arm in an attribution report (``--compare A:B``): every difference recomputed
from the per-image arrays, pairs of cells that scored different images refused, and the option
refused in one line where it does not apply.

Tiny random models as in tests/test_attribution.py: one arm with two register tokens, one
without, two seeds each, scored on the same five images. Tolerance 1e-12 (the same float64
sums in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_attribution import batch, make, max_diff

from reports.attribution import arm_pairs
from reports.build import parse_compare
from workbench.kinds import BY_NAME
from reports.collect import ReportError
from reports.render import Heading, Para, Table
from tracking.kinds.attribution_runs import AttributionCellResult, per_image_arrays
from workbench.attribution import score_cell
from workbench.attribution.controls import Controls

METHODS = ["cls_attention", "rollout", "chefer", "random", "oracle"]
N = 5


def _cells(family: str) -> dict[int, AttributionCellResult]:
    out = {}
    for seed in (0, 1):
        model, (x, y) = make(family, seed=seed), batch(N, seed=seed + 1)
        cell = score_cell(
            model,
            x,
            y,
            METHODS,
            seed=0,
            image_index=np.arange(N) + 100,
            counts=[0, 4, 8, 12, 16],
            controls=Controls(4, False, seed),
        )
        out[seed] = AttributionCellResult(None, per_image_arrays(cell, np.zeros((0, 1, 8, 8))))
    return out


@pytest.fixture(scope="module")
def arms():
    return _cells("registers"), _cells("plain")


def test_each_difference_is_the_seed_means_of_the_two_arms(arms):
    reg, plain = arms
    rows = arm_pairs.arm_differences(reg, plain, [0, 1], 50, 0.95, 0)
    assert {(r.method, r.measure) for r in rows} == {
        (m, k) for m in METHODS for k in ("rho", "deletion_auc", "insertion_auc")
    }
    r = next(r for r in rows if r.method == "chefer" and r.measure == "rho")
    want = [
        np.nanmean(reg[s].arrays["rho/chefer"]) - np.nanmean(plain[s].arrays["rho/chefer"])
        for s in (0, 1)
    ]
    assert max_diff(r.versus.differences, want) <= 1e-12, max_diff(r.versus.differences, want)

    def beyond(cells, s):
        draws = cells[s].arrays["random_draws/rho"].mean(axis=0)
        return np.nanmean(cells[s].arrays["rho/chefer"] - draws)

    want = [beyond(reg, s) - beyond(plain, s) for s in (0, 1)]
    got = r.beyond_draws.differences
    assert max_diff(got, want) <= 1e-12, max_diff(got, want)
    random_row = next(r for r in rows if r.method == "random" and r.measure == "rho")
    assert random_row.beyond_draws is None  # the random order is the draws' own kind
    # the bootstrap pairs the same images: an arm against itself differs by exactly nothing
    same = arm_pairs.arm_differences(reg, reg, [0, 1], 50, 0.95, 0)
    assert all(s.bootstrap.low == s.bootstrap.high == 0.0 and s.settled() == 0 for s in same)


def test_the_section_has_a_sentence_the_differences_and_one_structure_row_per_block(arms):
    reg, plain = arms
    blocks = arm_pairs.pair_blocks(
        "reg",
        "plain",
        reg,
        plain,
        n_resamples=50,
        confidence=0.95,
        seed=0,
        norm_threshold=10.0,
        split="validation",
    )
    assert isinstance(blocks[0], Heading) and isinstance(blocks[1], Para)
    differences, structure = [b for b in blocks if isinstance(b, Table)]
    assert len(differences.rows) == 3 * len(METHODS)
    depth = reg[0].arrays["norms"].shape[0]
    assert len(structure.rows) == depth
    # the plain arm has no registers: its share on them is shown as none, the other arm's as a number
    assert all(row[-1].endswith(" / –") and row[-1][0].isdigit() for row in structure.rows), (
        structure.rows
    )


def test_cells_that_scored_other_images_or_no_common_seed_are_refused(arms):
    reg, plain = arms
    moved = {s: AttributionCellResult(None, dict(c.arrays)) for s, c in plain.items()}
    moved[1].arrays["indices"] = moved[1].arrays["indices"] + 1
    with pytest.raises(
        arm_pairs.ArmPairError, match="--compare reg:plain: seed 1's cells scored different images"
    ):
        arm_pairs.shared_seeds("reg", "plain", reg, moved)
    with pytest.raises(arm_pairs.ArmPairError, match="no reported seed in common"):
        arm_pairs.shared_seeds("reg", "plain", {0: reg[0]}, {1: plain[1]})


def test_compare_is_refused_in_one_line_where_it_does_not_apply():
    class Acted:  # what check_compare reads of a protocol
        name = "p"
        arms = ["base", "base_reg4"]

    BY_NAME["attribution"].load("report").check_compare(Acted, [("base_reg4", "base")])
    with pytest.raises(
        ReportError,
        match=r"--compare base:p4: p4 is not an arm p acts on \(arms: base, base_reg4\)",
    ):
        BY_NAME["attribution"].load("report").check_compare(Acted, [("base", "p4")])
    with pytest.raises(ReportError, match="--compare: not for an intervention protocol"):
        BY_NAME["intervention"].load("report").check_compare(Acted, [("base_reg4", "base")])
    with pytest.raises(ReportError, match="an arm against itself"):
        parse_compare(["base:base"])


def test_the_pairs_travel_with_the_evidence_and_old_exports_read_as_none():
    from reports.common.evidence_parts import evidence_document, exported_inputs
    from reports.provenance import BuildInputs

    inputs = BuildInputs(
        "file p.yaml", "ab" * 32, None, None, [("base_reg4", "base")], 100, 0, 0.95, True
    )
    p = {"name": "p", "source": "file p.yaml", "hash": "ab" * 32}
    doc = evidence_document(
        "f", p, tracking_uri="sqlite://", inputs=inputs, logged_to=[], parents=[], cells=[]
    )
    assert exported_inputs(p, doc["build"], 0, 0.95) == inputs
    without = BuildInputs("file p.yaml", "ab" * 32, None, None, [], 100, 0, 0.95, True)
    plain = evidence_document(
        "f", p, tracking_uri="sqlite://", inputs=without, logged_to=[], parents=[], cells=[]
    )
    assert "compare" not in plain["build"]  # an export without pairs keeps the keys it always had
    assert exported_inputs(p, plain["build"], 0, 0.95).compare == []
