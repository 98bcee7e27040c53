"""A claim states what its sentence says of its numbers (its relations: below, not settled, in k
of n seeds, still improving, agree, ...) and the check recomputes each from the evidence, as it
does a digit (reports/published/claims.py). Each over-read of issue 48 is kept here as it was
published, with the relation its words assert, and must fail; its corrected claim in
docs/results/claims.yaml must pass."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from reports.published.claims import (
    Claim,
    ClaimError,
    load_claims,
    recompute,
    relation_problems,
    wording,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
CLAIMS = RESULTS / "claims.yaml"

# The sentences as they were published before issue 48, each with the claim its words make.
OLD_CLAIMS = """
claims:
  - id: old.controls
    sentence: >-
      CLS attention +0.010 [−0.036, +0.055], rollout +0.025 and gradient × input +0.065 rank below
      a map of mean pixel intensity (+0.093) that ignores the model
    compute:
      - {name: faithfulness_pair, study: fmnist_seed_recipe_faithfulness_controls, arm: vit, a: rollout, b: intensity, measure: rho}
      - {name: faithfulness_pair, study: fmnist_seed_recipe_faithfulness_controls, arm: vit, a: grad_x_input, b: intensity, measure: rho}
    numbers: {}
    relations:
      - {is: below, of: [0, 1], words: "rank below"}
  - id: old.curves
    sentence: >-
      The curves have mostly flattened: late slopes +0.24 to +0.31 points per epoch bare and +0.15
      to +0.27 with the recipe
    compute:
      - {name: convergence, study: cifar10_recipe_20ep, arm: base}
      - {name: convergence, study: cifar10_recipe_20ep, arm: full_recipe}
    numbers: {0.slope_min: "+0.24", 0.slope_max: "+0.31", 1.slope_min: "+0.15", 1.slope_max: "+0.27"}
    relations:
      - {is: mostly flattened, of: [0, 1], words: "curves have mostly flattened"}
  - id: old.heads4
    sentence: "`heads4` − `base` −1.26 [−1.35, −1.17], 0 of 3"
    compute:
      - {name: accuracy_difference, study: cifar10_seed_table, a: heads4, b: base, split: val}
    numbers: {mean: "−1.26", low: "−1.35", high: "−1.17", wins: "0", n: "3"}
    relations:
      - {is: holds in k of n, words: "0 of 3"}
  - id: old.one_head
    sentence: "one head zero-ablated alone costs 0.975 to 2.70 points (mean over seeds)"
    compute:
      - {name: heads_costing_less, study: fmnist_seed_recipe_heads, arm: vit, ablation: zero, threshold: 1.0}
    numbers: {smallest_drop: "0.975", largest_drop: "2.70"}
    relations:
      - {is: range over seeds, words: "costs 0.975 to 2.70 points (mean over seeds)"}
  - id: old.random_orders
    sentence: >-
      The random orders' mean is ρ +0.001, deletion 0.534, a single order's spread about 0.007 in ρ.
    compute:
      - {name: random_draws, study: fmnist_seed_recipe_faithfulness_controls, arm: vit, measure: rho}
      - {name: random_draws, study: fmnist_seed_recipe_faithfulness_controls, arm: vit, measure: deletion_auc}
    numbers: {0.mean: "+0.001", 1.mean: "0.534", 0.sd: "0.007"}
    relations:
      - {is: mean of the draws, of: [0, 1], words: "The random orders' mean is ρ +0.001, deletion 0.534"}
  - id: old.patching
    sentence: >-
      The seeds agree on the blocks x positions map (Spearman 0.77 to 0.89 between pairs of seeds).
    compute:
      - {name: patching_agreement, study: fmnist_seed_recipe_patching, arm: vit}
    numbers: {min: "0.77", max: "0.89"}
    relations:
      - {is: agree, words: "The seeds agree"}
"""


@pytest.fixture(scope="module")
def old(tmp_path_factory) -> dict[str, Claim]:
    path = tmp_path_factory.mktemp("claims") / "old.yaml"
    path.write_text(OLD_CLAIMS)
    return {c.id: c for c in load_claims(path)}


@pytest.fixture(scope="module")
def new() -> dict[str, Claim]:
    return {c.id: c for c in load_claims(CLAIMS)}


def _claim(relations: list[dict], sentence: str = "a − b −0.05 [−0.10, 0.00]") -> Claim:
    return Claim("synthetic", sentence, {}, [{"name": "synthetic"}], tuple(relations))


def _interval(mean: float, low: float, high: float, wins: int = 0, losses: int = 5) -> dict:
    return {"mean": mean, "low": low, "high": high, "wins": wins, "losses": losses, "n": 5}


def test_below_fails_on_an_interval_touching_zero_and_not_settled_must_be_worded_so():
    touching = _interval(-0.05, -0.10, 0.0)
    below = {"is": "below", "of": 0, "words": "ranks below"}
    problems = relation_problems(_claim([below], "a ranks below b"), [touching])
    assert problems == [
        "synthetic: below ('ranks below') does not hold: the interval -0.05 [-0.1, +0] is not "
        "below zero"
    ], problems
    clear = _interval(-0.05, -0.10, -0.001)
    assert relation_problems(_claim([below], "a ranks below b"), [clear]) == []
    unsettled = {"is": "not settled", "of": 0, "words": "not settled"}
    assert relation_problems(_claim([unsettled], "a − b, not settled"), [touching]) == []
    # the relation right but the words say another: "rank below" is not "not settled"
    worded = {"is": "not settled", "of": 0, "words": "ranks below"}
    problems = relation_problems(_claim([worded], "a ranks below b"), [touching])
    assert len(problems) == 2 and "its words do not say it" in problems[0], problems
    assert "its words say ['below']" in problems[1], problems
    # a relation word of the sentence that no stated relation covers
    problems = wording(_claim([unsettled], "a ranks below b, not settled"))
    assert len(problems) == 1 and "'below'" in problems[0], problems


def test_a_seed_count_is_where_the_sign_holds_and_counts_are_recomputed():
    negative = _interval(-1.26, -1.35, -1.17, wins=0, losses=3) | {"n": 3}
    holds = {"is": "holds in k of n", "words": "0 of 3"}
    problems = relation_problems(_claim([holds], "−1.26, 0 of 3"), [negative])
    assert problems == [
        "synthetic: holds in k of n ('0 of 3'): its words do not say it: need 3 of 3"
    ], problems
    holds = {"is": "holds in k of n", "words": "behind in 3 of 3"}
    assert relation_problems(_claim([holds], "−1.26, behind in 3 of 3"), [negative]) == []


def test_an_unknown_relation_is_named_in_one_line(tmp_path):
    bad = tmp_path / "claims.yaml"
    bad.write_text(
        "claims:\n  - {id: x, sentence: s, numbers: {}, compute: {name: accuracy},"
        " relations: [{is: lower-ish, words: s}]}\n"
    )
    with pytest.raises(ClaimError, match=r"claims\[0\] \(x\): relation 'lower-ish'; valid: "):
        load_claims(bad)


def test_controls_rank_below_fails_and_the_corrected_row_passes(old, new):
    problems = recompute(old["old.controls"], RESULTS)
    assert len(problems) == 1 and "does not hold" in problems[0], problems
    assert "[-0.1373, +0.0003782]" in problems[0] and "[-0.0796, +0.02298]" in problems[0]
    # the claim as it stood (no relation): its "below" is in no stated relation
    as_it_stood = replace(old["old.controls"], relations=())
    assert recompute(as_it_stood, RESULTS) == [
        "old.controls: states no relation (the claims file's ``relations``)"
    ]
    as_not_settled = replace(
        old["old.controls"], relations=({"is": "not settled", "of": [0, 1], "words": "rank below"},)
    )
    assert len(recompute(as_not_settled, RESULTS)) == 2
    assert recompute(new["fmnist_seed_recipe_faithfulness_controls.headline"], RESULTS) == []


def test_mostly_flattened_fails_where_the_report_classes_4_of_6_still_improving(old, new):
    problems = recompute(old["old.curves"], RESULTS)
    assert problems == [
        "old.curves: mostly flattened ('curves have mostly flattened') does not hold: 4 of 6 "
        "cells are still improving (the report's convergence rule)"
    ], problems
    assert recompute(new["cifar10_recipe_20ep.convergence"], RESULTS) == []
    assert recompute(new["cifar10_recipe_20ep.headline"], RESULTS) == []


def test_0_of_3_fails_where_the_sign_holds_in_3_of_3(old, new):
    problems = recompute(old["old.heads4"], RESULTS)
    assert problems == [
        "old.heads4: holds in k of n ('0 of 3'): its words do not say it: need 3 of 3"
    ], problems
    assert recompute(new["cifar10_seed_table.headline"], RESULTS) == []


def test_a_head_range_averaged_over_seeds_fails_and_the_costliest_head_per_seed_passes(old, new):
    problems = recompute(old["old.one_head"], RESULTS)
    assert len(problems) == 4, problems
    assert "not a range over seeds: ['0.smallest_drop', '0.largest_drop']" in problems[0]
    assert "its words do not say it: need one of ['seed by seed'" in problems[1], problems
    assert all("a head index names a different head" in p for p in problems[2:]), problems
    assert recompute(new["fmnist_seed_recipe_heads.headline"], RESULTS) == []
    assert recompute(new["fmnist_seed_recipe_heads.costliest_head"], RESULTS) == []


def test_one_random_draw_shown_as_the_draws_mean_fails(old, new):
    problems = recompute(old["old.random_orders"], RESULTS)
    assert len(problems) == 2, problems
    assert problems[0].startswith("old.random_orders: mean of the draws (")
    assert problems[0].endswith("): its words do not say it: need 10 random orders"), problems
    assert problems[1] == "old.random_orders: 1.mean is shown as 0.534 but the evidence gives 0.529"
    draw0 = replace(old["old.random_orders"], numbers={"1.draw0": "0.534"})
    assert any("shows a single draw as the draws' mean: ['1.draw0']" in p for p in recompute(draw0))
    assert recompute(new["fmnist_seed_recipe_faithfulness_controls.random_draws"], RESULTS) == []


def test_patching_agreement_leaves_out_places_fixed_by_construction(old, new):
    problems = recompute(old["old.patching"], RESULTS)
    assert problems == [
        "old.patching: agree ('The seeds agree') does not hold: the pairs' Spearman (mean, min) "
        "reads agree weakly (agree: every pair >= 0.5)",
        "old.patching: min is shown as 0.77 but the evidence gives 0.25",
        "old.patching: max is shown as 0.89 but the evidence gives 0.72",
    ], problems
    assert recompute(new["fmnist_seed_recipe_patching.seed_agreement"], RESULTS) == []
