"""reports.content.comparison: one call gives consistent content for a comparison and an arm."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
from scipy import stats as sps

from workbench import stats
from reports.content.comparison import arm_content, comparison_content
from reports.content.wording import results_paragraph


def test_comparison_content_is_consistent_with_the_statistics():
    rng = np.random.default_rng(0)
    per_a, per_b, acc_a, acc_b = {}, {}, {}, {}
    for s in (0, 1, 2):
        y = rng.integers(0, 10, 800)
        pa, pb = (
            np.where(rng.random(800) < 0.85, y, (y + 1) % 10),
            np.where(rng.random(800) < 0.8, y, (y + 1) % 10),
        )
        per_a[s], per_b[s] = (y, pa), (y, pb)
        acc_a[s], acc_b[s] = float((pa == y).mean()), float((pb == y).mean())
    pc = stats.paired_seed_comparison(acc_a, acc_b, names=("cnn", "vit"))
    ci = stats.paired_hierarchical_bootstrap(per_a, per_b, "accuracy", n_resamples=1000, seed=0)
    content = comparison_content(pc, ci, acc_a, acc_b, a_label="cnn", b_label="vit")
    assert content.paragraph == results_paragraph(pc, ci, a_label="cnn", b_label="vit")
    d = np.array(pc.differences)
    assert abs(content.effect.d_z - d.mean() / d.std(ddof=1)) < 1e-12
    # 800 examples: values are multiples of 0.125 points, shown exactly with 3 decimals.
    assert content.per_seed.decimals == 3 and content.per_seed.exact
    for shown, true in zip(content.per_seed.differences, d * 100):
        assert abs(float(Decimal(shown)) - true) < 1e-9, (shown, true)
    r = content.forest_row
    assert (r.mean_difference, r.t_low, r.t_high, r.boot_low, r.boot_high, r.wins, r.n) == (
        pc.mean_difference,
        pc.ci_low,
        pc.ci_high,
        ci.low,
        ci.high,
        pc.wins,
        3,
    )
    assert content.bootstrap is not None and content.bootstrap.n_resamples == 1000
    assert (
        comparison_content(pc, None, acc_a, acc_b, a_label="cnn", b_label="vit").bootstrap is None
    )


def test_arm_content_text_and_interval():
    values = {0: 0.8025, 1: 0.7975, 2: 0.8100}
    arm = arm_content(values)
    v = np.array(list(values.values()))
    low, high = sps.t.interval(0.95, 2, loc=v.mean(), scale=sps.sem(v))
    assert max(abs(arm.interval.low - low), abs(arm.interval.high - high)) < 1e-12
    assert (
        arm.text
        == f"{v.mean() * 100:.2f} (95% t-interval {low * 100:.2f} to {high * 100:.2f}; 3 seeds)"
    )
    assert arm_content({0: 0.5}).text == "50.00 (1 seed; one seed: no spread, no interval)"
