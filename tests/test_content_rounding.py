"""reports.content.rounding: displayed differences equal differences of displayed values."""

from __future__ import annotations

from decimal import Decimal

import numpy as np

from workbench import stats
from reports.content import rounding


def test_issue_example_rounds_values_first():
    # 68.375 beside 39.50 was shown with difference +28.87; rounded first it is +28.88.
    shown = rounding.paired_display([0.68375], [0.395], decimals=2)
    assert (shown.a, shown.b, shown.differences) == (["68.38"], ["39.50"], ["+28.88"])
    assert not shown.exact
    # Without fixed decimals the values need 3 to be exact, and then every difference is the true one.
    exact = rounding.paired_display([0.68375], [0.395])
    assert (exact.a, exact.b, exact.differences, exact.decimals, exact.exact) == (
        ["68.375"],
        ["39.500"],
        ["+28.875"],
        3,
        True,
    )


def test_displayed_differences_are_recomputable_from_displayed_values():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n_examples = int(rng.choice([800, 5000, 10000, 400, 333]))
        a = rng.integers(0, n_examples + 1, 3) / n_examples
        b = rng.integers(0, n_examples + 1, 3) / n_examples
        for decimals in (None, 1, 2):
            shown = rounding.paired_display(a, b, decimals=decimals)
            for x, y, d in zip(shown.a, shown.b, shown.differences):
                assert Decimal(x) - Decimal(y) == Decimal(d), (
                    f"trial {trial}: {x} - {y} shown as {d}"
                )
            if (
                shown.exact
            ):  # displayed values are the data: the differences are the true ones to 1e-9
                true = (a - b) * 100
                assert np.abs(np.array([float(d) for d in shown.differences]) - true).max() < 1e-9


def test_exact_decimals_and_half_up_rounding():
    assert rounding.exact_decimals([80.0, 79.5]) == 2 and rounding.exact_decimals([68.375]) == 3
    assert rounding.exact_decimals([100 / 3]) == 3  # never exact: the cap
    # Binary noise must not flip the last digit: 0.68375 * 100 is 68.37499999999999 in float.
    assert rounding.fmt(0.68375 * 100, 2) == "68.38" and rounding.fmt(-0.125, 2) == "-0.13"
    assert (
        rounding.fmt(0.0, 2, signed=True) == "0.00"
        and rounding.fmt(-0.001, 2, signed=True) == "0.00"
    )
    assert rounding.fmt(float("nan"), 2) == "n/a" and rounding.fmt(2.5, 1, signed=True) == "+2.5"


def test_bootstrap_display_drops_digits_below_monte_carlo_error():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 800)
    pa = np.where(rng.random(800) < 0.8, y, 1 - y)
    pb = np.where(rng.random(800) < 0.75, y, 1 - y)
    ci = stats.paired_bootstrap_difference(y, pa, pb, "accuracy", n_resamples=2000, seed=0)
    shown = rounding.bootstrap_display(ci)
    se = max(ci.mc_error_low, ci.mc_error_high) * 100
    assert abs(shown.mc_error - se) < 1e-12
    # 2,000 resamples: ~0.1 pp, one decimal
    assert 0.01 <= se < 1.0 and shown.decimals == 1, (
        se,
        shown,
    )
    assert (
        abs(float(shown.low) - ci.low * 100) <= 0.05 + 1e-9
        and abs(float(shown.high) - ci.high * 100) <= 0.05 + 1e-9
    )
    assert "2,000 resamples" in shown.footnote and "Monte-Carlo standard error" in shown.footnote
    # 100x the resamples: the error shrinks (to the 0.125-point lattice of 800 examples, whose
    # order-statistic estimate is one lattice step / 3.92 = 0.032 at most), never grows.
    fine = rounding.bootstrap_display(
        stats.paired_bootstrap_difference(y, pa, pb, "accuracy", n_resamples=200_000, seed=0)
    )
    assert (
        fine.mc_error <= 0.125 / (2 * 1.9599) + 1e-9
        and fine.mc_error < se / 3
        and fine.decimals >= 1
    ), (fine.mc_error, se)
