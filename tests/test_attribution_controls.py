"""Controls of attribution maps: baselines, the planted oracle, per-image random draws, the
model-randomisation check, Fisher-z intervals, and the report sections built from them.

Tiny random models as in tests/test_attribution.py (16 patch tokens, depth 2). Each check
states its tolerance and prints the largest difference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps
from test_attribution import batch, make, max_diff

from reports.attribution import control_blocks
from reports.attribution import controls
from reports.attribution.faithfulness import faithfulness_rows
from reports.render import Table
from tracking.kinds.attribution_runs import AttributionCellResult, per_image_arrays
from workbench.attribution import score_cell, spearman_per_image
from workbench.attribution.controls import (
    Controls,
    centre,
    intensity,
    random_draw_scores,
    randomisation_check,
    randomised_blocks,
)
from workbench.protocol.attribution import AttributionProtocolError, parse_attribution_protocol
from workbench.stats import fisher_z_interval

ALL = [
    "cls_attention",
    "rollout",
    "chefer",
    "grad_x_input",
    "random",
    "intensity",
    "centre",
    "oracle",
]


def scored(seed: int = 0, n: int = 5, draws: int = 4, sanity: bool = True):
    model, (x, y) = make("registers", seed=seed), batch(n, seed=seed + 1)
    cell = score_cell(
        model,
        x,
        y,
        ALL,
        seed=0,
        image_index=np.arange(n) + 100,
        counts=[0, 4, 8, 12, 16],
        controls=Controls(draws, sanity, seed),
    )
    return model, x, y, cell


@pytest.fixture(scope="module")
def two_cells():
    return {s: scored(seed=s) for s in (0, 1)}


def test_the_oracle_has_rho_one_on_synthetic_effects_and_in_a_cell(two_cells):
    effects = np.random.default_rng(0).normal(size=(7, 16))
    rho = spearman_per_image(effects, effects)
    assert max_diff(rho, np.ones(7)) <= 1e-12, f"oracle rho on planted effects: {max_diff(rho, 1)}"
    _, _, _, cell = two_cells[0]
    assert np.array_equal(cell.scores["oracle"], cell.causal.effects)
    assert max_diff(cell.rho["oracle"], np.ones(5)) <= 1e-12, cell.rho["oracle"]


def test_random_draws_are_seeded_per_cell_image_and_draw_and_spread(two_cells):
    a = random_draw_scores(16, 0, 3, [5, 6, 7], 4)
    assert a.shape == (4, 3, 16)
    assert np.array_equal(a, random_draw_scores(16, 0, 3, [5, 6, 7], 4))  # reproducible
    # an image's draws do not depend on the images beside it
    assert np.array_equal(a[:, 2], random_draw_scores(16, 0, 3, [7], 4)[:, 0])
    assert not np.array_equal(a, random_draw_scores(16, 0, 4, [5, 6, 7], 4))  # another cell
    assert not np.array_equal(a, random_draw_scores(16, 1, 3, [5, 6, 7], 4))  # another seed
    assert not np.array_equal(a[0, 0], a[1, 0]) and not np.array_equal(a[0, 0], a[0, 1])
    _, _, _, cell = two_cells[0]
    # random is each image's draw 0: its rho equals the first draw's
    assert max_diff(cell.rho["random"], cell.draws["rho"][0]) <= 1e-12
    for measure, values in cell.draws.items():
        means = np.nanmean(values, axis=1)
        assert values.shape == (4, 5) and means.std() > 0, f"{measure}: no spread {means}"


def test_the_baselines_are_the_definitions():
    model, (x, y) = make("plain"), batch(3)
    got = intensity(model, x, y)
    want = x[:, 0].double().reshape(3, 4, 2, 4, 2).mean(dim=(2, 4)).reshape(3, 16)
    assert max_diff(got, want) <= 1e-12, max_diff(got, want)
    c = centre(model, x, y)
    assert torch.equal(c[0], c[2]) and c[0].argmax() in (5, 6, 9, 10)  # the four central patches
    assert max_diff(c[0][5], -math.hypot(0.5, 0.5)) <= 1e-12


def test_the_randomisation_check_flags_maps_that_do_not_depend_on_the_weights(two_cells):
    model, x, y, cell = two_cells[0]
    for m in ("intensity", "centre"):
        assert max_diff(cell.sanity[m], 1.0) <= 1e-12, f"{m} changed with random weights"
    assert cell.sanity["chefer"].shape == (2, 5)
    assert np.nanmean(cell.sanity["chefer"][-1]) < 0.99  # a map that reads the weights moves
    random_model = randomised_blocks(model, 2, seed=0)
    assert not torch.equal(random_model.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)
    assert torch.equal(random_model.patch_proj.weight, model.patch_proj.weight)
    top_only = randomised_blocks(model, 1, seed=0)
    assert torch.equal(top_only.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)
    cells = {
        s: AttributionCellResult(None, per_image_arrays(c, np.zeros((0, 1, 8, 8))))
        for s, (*_, c) in two_cells.items()
    }
    flagged = {r.method: r.survives for r in controls.sanity(cells)}
    assert flagged["intensity"] and flagged["centre"] and not flagged["chefer"], flagged
    # the check's own function on a map of the trained model: rho 1 when nothing changes
    same = randomisation_check(
        model, x, y, ["intensity"], {"intensity": cell.scores["intensity"]},
        lambda mo, xx, yy, m: intensity(mo, xx, yy), seed=0,
    )  # fmt: skip
    assert max_diff(same["intensity"], 1.0) <= 1e-12


def test_fisher_z_intervals_stay_inside_minus_one_one():
    values = [0.95, -0.3, 0.99]
    low, high = fisher_z_interval(values, 0.95)
    raw = sps.t.interval(0.95, 2, loc=np.mean(values), scale=sps.sem(values))
    assert raw[1] > 1.0 and -1.0 <= low < high <= 1.0, (raw, low, high)
    z = np.arctanh(values)
    want = np.tanh(sps.t.interval(0.95, 2, loc=z.mean(), scale=sps.sem(z)))
    assert max_diff([low, high], want) <= 1e-12
    assert math.isnan(fisher_z_interval([0.5])[0])


def test_the_report_sections_compare_with_the_draws_every_pair_and_every_class(two_cells):
    cells = {
        s: AttributionCellResult(None, per_image_arrays(c, np.zeros((0, 1, 8, 8))))
        for s, (*_, c) in two_cells.items()
    }
    draws = controls.against_draws(cells, 50, 0.95, 0)
    methods = [m for m in ALL if m != "random"]
    assert len(draws) == 3 * len(methods)
    d = next(r for r in draws if r.method == "chefer" and r.measure == "rho")
    want = {
        s: np.nanmean(c.rho["chefer"]) - np.mean([np.nanmean(r) for r in c.draws["rho"]])
        for s, (*_, c) in two_cells.items()
    }
    assert max_diff(d.versus.differences, [want[0], want[1]]) <= 1e-12
    pairs = controls.pairwise(cells, 50, 0.95, 0)
    assert len(pairs) == 3 * len(methods) * (len(methods) - 1) // 2
    rows = controls.per_class(cells)
    r = next(r for r in rows if r.method == "oracle" and r.measure == "rho")
    assert all(max_diff(r.mean(k), 1.0) <= 1e-12 for k in r.per_class)
    start = controls.insertion_start(cells)
    _, x, _, cell = two_cells[0]
    assert start[0].true_class_prob == pytest.approx(
        cell.curves.insertion_prob["chefer"][:, 0].mean(), abs=1e-12
    )
    assert start[0].share == 1.0  # the class token alone is one sequence: one class for every image
    blocks = control_blocks.control_blocks(
        "vit", [], cells, draws, confidence=0.95, n_resamples=50, seed=0, dataset=None, title="t"
    )
    tables = [b for b in blocks if isinstance(b, Table)]
    assert any(t.header[0] == "measure" and "SD of the draws' means" in t.header for t in tables)
    warned = control_blocks.near_chance("vit", cells, num_classes=3)
    accuracy = [float((c.arrays["predicted"] == c.arrays["labels"]).mean()) for c in cells.values()]
    assert len(warned) == sum(a < 2 / 3 for a in accuracy)
    # The number printed as the threshold is the threshold (2 x 1/10 = 20 %), chance beside it.
    cell = next(iter(cells.values()))
    wrong = type(cell)(cell.record, {**cell.arrays, "predicted": cell.arrays["labels"] + 1})
    (line,) = control_blocks.near_chance("vit", {0: wrong}, num_classes=10)
    assert (
        "accuracy 0.00 % on the scored images, below 2 × chance, 20.00 % (chance: 10.00 %)" in line
    ), line


def test_protocol_controls_are_optional_and_checked(tmp_path):
    base = {
        "name": "p",
        "description": "d",
        "pretrained": {"model": "vit_tiny_patch16_224", "weights": "random", "dataset": "cifar10"},
        "attribution": {"methods": ["chefer", "random"]},
    }
    plain = parse_attribution_protocol(base, "p.yaml")
    assert "random_draws" not in plain.canonical["attribution"]
    assert plain.settings.random_draws == 0 and not plain.settings.sanity_check
    zero = parse_attribution_protocol(
        {**base, "attribution": {**base["attribution"], "random_draws": 0}}, "p.yaml"
    )
    assert zero.hash == plain.hash  # a default written out is the default left out
    on = parse_attribution_protocol(
        {**base, "attribution": {"methods": ALL, "random_draws": 10, "sanity_check": True}},
        "p.yaml",
    )
    assert on.hash != plain.hash and on.canonical["attribution"]["random_draws"] == 10
    with pytest.raises(AttributionProtocolError, match=r"p.yaml: attribution.random_draws=1"):
        parse_attribution_protocol({**base, "attribution": {"random_draws": 1}}, "p.yaml")
    with pytest.raises(AttributionProtocolError, match="add random"):
        parse_attribution_protocol(
            {**base, "attribution": {"methods": ["chefer"], "random_draws": 10}}, "p.yaml"
        )


def test_a_map_without_rho_in_every_seed_has_no_comparison_row_and_breaks_nothing(two_cells):
    cells = {
        s: AttributionCellResult(None, per_image_arrays(c, np.zeros((0, 1, 8, 8))))
        for s, (*_, c) in two_cells.items()
    }
    for cell in cells.values():  # as for a centre prior on a grid where every patch is as central
        cell.arrays["rho/centre"] = np.full_like(cell.arrays["rho/centre"], np.nan)
    draws = controls.against_draws(cells, 20, 0.95, 0)
    assert not any(d.method == "centre" and d.measure == "rho" for d in draws)
    assert any(d.method == "centre" and d.measure == "deletion_auc" for d in draws)
    pairs = controls.pairwise(cells, 20, 0.95, 0)
    assert not any("centre" in (p.a, p.b) and p.measure == "rho" for p in pairs)
    rows = faithfulness_rows(cells, 20, 0.95, 0)
    blocks = control_blocks.control_blocks(
        "vit", rows, cells, draws, confidence=0.95, n_resamples=20, seed=0, dataset=None, title="t"
    )
    assert blocks and control_blocks.answers("vit", rows, cells, 0.95, draws).items


def test_adifference_interval_is_cut_to_the_range_a_difference_can_take():
    assert control_blocks.difference_interval("rho", -6.659, 7.459) == "[-2.000, +2.000] ‡"
    assert control_blocks.difference_interval("deletion_auc", -0.2, 1.3) == "[-0.200, +1.000] ‡"
    assert control_blocks.difference_interval("rho", -0.5, 0.25) == "[-0.500, +0.250]"
