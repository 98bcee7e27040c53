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
from reports.render import Para, Table
from tracking.kinds.attribution_runs import AttributionCellResult, per_image_arrays
from workbench.attribution import score_cell, spearman_per_image
from workbench.attribution.agreement import abs_spearman_per_image, ssim_per_image
from workbench.attribution.controls import (
    Controls,
    cascade_layers,
    centre,
    intensity,
    random_draw_scores,
    randomisation_check,
    randomised,
    randomised_models,
    reinitialised,
)
from workbench.models.vit import VisionTransformer
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


def as_cells(two_cells) -> dict[int, AttributionCellResult]:
    return {
        s: AttributionCellResult(None, per_image_arrays(c, np.zeros((0, 1, 8, 8))))
        for s, (*_, c) in two_cells.items()
    }


def test_the_cascade_runs_from_the_logits_down_over_every_parameter():
    model = make("registers")
    layers = cascade_layers(model)
    assert [name for name, _ in layers] == ["head", "norm", "blocks.1", "blocks.0", "embed"]
    owned = [n for _, params in layers for n in params]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters()), (
        "a parameter in no layer"
    )
    assert len(owned) == len(set(owned)), "a parameter in two layers"
    assert set(dict(layers)["embed"]) >= {"patch_proj.weight", "pos_embed", "cls_token"}


def test_the_reinitialisation_is_the_models_own_init_drawn_once():
    model = make("registers")
    before = torch.random.get_rng_state()
    draw = reinitialised(model, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before), "the global generator moved"
    torch.manual_seed(3)
    fresh = dict(VisionTransformer(model.cfg).named_parameters())
    for n, v in draw.items():  # exactly what the model's constructor draws under that seed
        assert torch.equal(v, fresh[n]), n
    assert abs(float(draw["blocks.0.attn.qkv.weight"].std()) - 0.02) <= 0.004  # trunc normal 0.02
    assert torch.equal(draw["head.bias"], torch.zeros_like(draw["head.bias"]))
    assert torch.equal(draw["norm.weight"], torch.ones_like(draw["norm.weight"]))  # LayerNorm init
    assert all(torch.equal(draw[n], reinitialised(model, 3)[n]) for n in draw)
    assert not torch.equal(draw["head.weight"], reinitialised(model, 4)["head.weight"])


def nesting_breaks(model, steps) -> list[str]:
    """Where a cascade is not nested: a layer randomised at step k that holds other values at k + 1,
    or a layer not yet reached that is not the trained one."""
    layers = cascade_layers(model)
    trained = dict(model.named_parameters())
    out = []
    for k, (_, now) in enumerate(steps):
        params = dict(now.named_parameters())
        nxt = dict(steps[k + 1][1].named_parameters()) if k + 1 < len(steps) else None
        for j, (_, names) in enumerate(layers):
            for n in names:
                if j > k and not torch.equal(params[n], trained[n]):
                    out.append(f"step {k}: {n} changed before its turn")
                if j <= k and nxt is not None and not torch.equal(params[n], nxt[n]):
                    out.append(f"step {k} -> {k + 1}: {n} drawn again")
    return out


def test_the_cascade_is_nested_and_the_old_fresh_noise_per_step_is_not():
    model = make("registers")
    steps = list(randomised_models(model, 0, "cascade"))
    assert [name for name, _ in steps] == [name for name, _ in cascade_layers(model)]
    breaks = nesting_breaks(model, steps)
    assert not breaks, breaks[:5]
    last = dict(steps[-1][1].named_parameters())
    draw = reinitialised(model, 0)
    assert max(max_diff(last[n].detach(), draw[n]) for n in draw) == 0.0  # every layer random
    # the check before issue 48: a fresh draw per step (seed + step) -- not nested
    # fmt: skip
    fresh_each = [
        (
            name,
            randomised(
                model,
                reinitialised(model, k),
                [n for _, p in cascade_layers(model)[: k + 1] for n in p],
            ),
        )
        for k, (name, _) in enumerate(cascade_layers(model))
    ]
    assert nesting_breaks(model, fresh_each), "the nesting test cannot fail"
    # independent: one layer random (the same values as the cascade's), every other trained
    trained = dict(model.named_parameters())
    for name, now in randomised_models(model, 0, "independent"):
        own = set(dict(cascade_layers(model))[name])
        for n, p in now.named_parameters():
            want = draw[n] if n in own else trained[n]
            assert torch.equal(p.detach(), want.detach()), f"independent {name}: {n}"


def test_ssim_and_absolute_rank_are_the_definitions():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 25)), rng.normal(size=(3, 25))
    assert max_diff(ssim_per_image(a, a, (5, 5)), 1.0) <= 1e-12
    assert max_diff(abs_spearman_per_image(a, -a), 1.0) <= 1e-12  # a sign flip keeps |rank|
    assert max_diff(spearman_per_image(a, -a), -1.0) <= 1e-12
    # Wang et al. 2004 by hand: Gaussian window sigma 1.5 (reflected border), C1 = (0.01)^2, C2 = (0.03)^2
    from scipy.ndimage import gaussian_filter

    def wang(x, y):
        x, y = [(v - v.min()) / np.ptp(v) for v in (x, y)]
        f = lambda v: gaussian_filter(v, 1.5, mode="reflect", truncate=3.5)  # noqa: E731
        mx, my = f(x), f(y)
        vx, vy, cxy = f(x * x) - mx**2, f(y * y) - my**2, f(x * y) - mx * my
        c1, c2 = 0.01**2, 0.03**2
        s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
        return s[1:-1, 1:-1].mean()  # the 1-patch border left out

    want = [wang(a[i].reshape(5, 5), b[i].reshape(5, 5)) for i in range(3)]
    got = ssim_per_image(a, b, (5, 5))
    assert max_diff(got, want) <= 1e-9, f"SSIM off by {max_diff(got, want)}"
    assert np.isnan(ssim_per_image(a[:, :4], b[:, :4], (2, 2))).all()  # no interior


def test_the_positive_control_holds_and_a_weight_reading_map_decays(two_cells):
    model, x, y, cell = two_cells[0]
    check = cell.sanity
    assert check.layers == ("head", "norm", "blocks.1", "blocks.0", "embed")
    for mode in ("cascade", "independent"):
        for metric in ("rho", "abs_rho", "ssim"):
            for m in ("intensity", "centre"):  # never run the model: 1 at every step
                values = getattr(check, mode)[metric][m]
                assert values.shape == (5, 5)
                assert max_diff(values, 1.0) <= 1e-12, (
                    f"{mode} {metric} {m}: {max_diff(values, 1.0)}"
                )
    grad = check.cascade["rho"]["grad_x_input"]
    # reads every weight: with every layer random its map is another map (measured mean -0.2)
    assert np.nanmean(grad[-1]) < 0.5, np.nanmean(grad, axis=1)
    assert np.nanmean(check.cascade["ssim"]["grad_x_input"][-1]) < 0.5
    # cls_attention reads no weight after the last block: the head and final norm cannot move it
    assert max_diff(check.cascade["rho"]["cls_attention"][:2], 1.0) <= 1e-9
    assert np.nanmean(check.cascade["rho"]["cls_attention"][2]) < 0.99
    flagged = {m: r.survives for m, r in controls.sanity_verdicts(as_cells(two_cells)).items()}
    assert flagged["intensity"] and flagged["centre"] and not flagged["grad_x_input"], flagged
    # the check's own function on maps of the trained model: 1 when nothing changes
    # fmt: skip
    same = randomisation_check(
        model,
        x,
        y,
        ["intensity"],
        {"intensity": cell.scores["intensity"]},
        lambda mo, xx, yy, m: intensity(mo, xx, yy),
        seed=0,
    )
    assert max_diff(same.cascade["ssim"]["intensity"], 1.0) <= 1e-12


def test_the_report_shows_both_forms_and_still_reads_old_evidence(two_cells):
    cells = as_cells(two_cells)
    blocks = control_blocks._sanity_blocks("vit", cells, "t")
    tables = [b for b in blocks if isinstance(b, Table)]
    assert [t.header[1:6] for t in tables] == [
        ["+ head", "+ norm", "+ blocks.1", "+ blocks.0", "+ embed"],
        ["head", "norm", "blocks.1", "blocks.0", "embed"],
    ]
    text = " ".join(b.text for b in blocks if isinstance(b, Para))
    assert "Positive control (vit)" in text and "the check itself is broken" not in text
    # the positive control catches a weight-free map that moved
    for c in cells.values():
        c.arrays["sanity_cascade/ssim/intensity"] = c.arrays["sanity_cascade/ssim/intensity"] * 0.5
    broken = control_blocks._sanity_blocks("vit", cells, "t")
    assert "the check itself is broken" in " ".join(b.text for b in broken if isinstance(b, Para))
    # evidence from before the cascade: sanity/<method> (blocks only), no layers, no SSIM
    old = as_cells(two_cells)
    for c in old.values():
        for k in [k for k in c.arrays if k.startswith("sanity_")]:
            del c.arrays[k]
        c.arrays |= {f"sanity/{m}": np.full((2, 5), 0.3) for m in ("chefer", "intensity")}
    assert controls.sanity_form(old) == "blocks"
    blocks = control_blocks._sanity_blocks("vit", old, "t")
    assert control_blocks.OLD_SANITY_NOTE in [b.text for b in blocks if isinstance(b, Para)]
    assert [b for b in blocks if isinstance(b, Table)][0].header[1] == "top 1 random"


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
    cells = as_cells(two_cells)
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
    cells = as_cells(two_cells)
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
