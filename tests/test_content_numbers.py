"""workbench.estimates: intervals, effect size, test resolution, Monte-Carlo error."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sps

from workbench import stats
from workbench import estimates


def assert_near(actual, expected, tol: float, what: str = "") -> None:
    a, e = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    diff = float(np.abs(a - e).max())
    assert diff <= tol, f"{what}: max |difference| {diff:.3g} > tolerance {tol:g} ({a} vs {e})"


def test_mean_interval_equals_scipy_t_interval():
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 10):
        v = rng.normal(0.8, 0.02, n)
        got = estimates.mean_interval(v)
        want = sps.t.interval(0.95, n - 1, loc=v.mean(), scale=sps.sem(v))
        assert_near([got.low, got.high], want, 1e-12, f"t-interval n={n}")
        assert_near([got.mean, got.sd], [v.mean(), v.std(ddof=1)], 1e-15, "mean, sd")
        assert got.n == n and got.note == ""


def test_mean_interval_hand_computed_three_seeds():
    # 0.80, 0.82, 0.84: mean 0.82, sd 0.02, t(0.975, 2) = 4.302653, half = 4.302653 * 0.02 / sqrt(3)
    got = estimates.mean_interval({0: 0.80, 1: 0.82, 2: 0.84})
    half = 4.302652729749464 * 0.02 / math.sqrt(3)
    assert_near([got.low, got.high], [0.82 - half, 0.82 + half], 1e-12, "hand t-interval")


def test_mean_interval_degenerate_cases_say_why():
    one = estimates.mean_interval([0.7])
    assert math.isnan(one.low) and math.isnan(one.high) and "one seed" in one.note
    same = estimates.mean_interval([0.5, 0.5, 0.5])
    assert same.low == same.high == 0.5 and "zero-width" in same.note
    with pytest.raises(ValueError, match="non-finite"):
        estimates.mean_interval([0.5, float("nan")])


def test_effect_size_value_and_exact_interval():
    d = np.array([4.0, 6.0, 2.5])  # d_z = mean / sd
    es = estimates.paired_effect_size(d)
    assert_near(es.d_z, d.mean() / d.std(ddof=1), 1e-12, "d_z")
    # The bounds are defined by the noncentral t: P(T <= t_obs | nc = bound * sqrt(n)) = 0.975 / 0.025.
    t_obs = es.d_z * math.sqrt(3)
    assert_near(sps.nct.cdf(t_obs, 2, es.low * math.sqrt(3)), 0.975, 1e-9, "low bound")
    assert_near(sps.nct.cdf(t_obs, 2, es.high * math.sqrt(3)), 0.025, 1e-9, "high bound")
    assert es.low < es.d_z < es.high
    # Hedges' J(2) = Gamma(1) / (1 * Gamma(1/2)) = 1 / sqrt(pi).
    assert_near(es.g_z, es.d_z / math.sqrt(math.pi), 1e-12, "g_z")
    assert (
        "3 seeds" in es.caveat and "2 degrees of freedom" in es.caveat and "imprecise" in es.caveat
    )


def test_effect_size_interval_matches_large_sample_approximation():
    rng = np.random.default_rng(1)
    d = rng.normal(0.5, 1.0, 400)
    es = estimates.paired_effect_size(d)
    se = math.sqrt(1 / 400 + es.d_z**2 / (2 * 400))  # normal approximation of the d_z sampling sd
    assert_near(
        [es.low, es.high], [es.d_z - 1.96 * se, es.d_z + 1.96 * se], 0.01, "large-n interval"
    )


def test_effect_size_undefined_cases():
    assert math.isnan(estimates.paired_effect_size([0.3]).d_z)
    # Nearly identical differences: t in the thousands, where scipy's noncentral t fails: no interval, said so.
    huge = estimates.paired_effect_size([1.0, 1.0001, 1.0002])
    assert huge.d_z > 1000 and "cannot be computed" in huge.caveat
    assert math.isnan(huge.low) and math.isnan(huge.high)
    # two seeds: one degree of freedom, no Hedges correction
    two = estimates.paired_effect_size([0.01, 0.03])
    assert (
        abs(two.d_z - math.sqrt(2)) < 1e-12
        and math.isnan(two.g_z)
        and "1 degree of freedom" in two.caveat
    )
    same = estimates.paired_effect_size([0.3, 0.3, 0.3])
    assert math.isnan(same.d_z) and "same difference" in same.caveat


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
def test_min_wilcoxon_p_equals_scipy_exact_test(n):
    d = np.arange(1, n + 1, dtype=float)  # all positive, distinct: the most extreme pattern
    want = sps.wilcoxon(d, method="exact").pvalue
    assert_near(estimates.min_wilcoxon_p(n), want, 1e-12, f"n={n}")
    assert_near(estimates.min_wilcoxon_p(3), 0.25, 0, "n=3 is 0.25")


def test_bootstrap_seed_multisets_by_enumeration():
    for n in range(1, 8):
        distinct = {tuple(sorted(c)) for c in itertools.product(range(n), repeat=n)}
        assert estimates.bootstrap_seed_multisets(n) == len(distinct), n
    assert (estimates.bootstrap_seed_multisets(2), estimates.bootstrap_seed_multisets(3)) == (3, 10)


def test_quantile_mc_error_matches_theory_and_repeated_draws():
    # R normal replicates: SE of the q-quantile is sqrt(q(1-q)/R) / phi(z_q) (asymptotic theory).
    r, q = 2000, 0.025
    theory = math.sqrt(q * (1 - q) / r) / sps.norm.pdf(sps.norm.ppf(q))
    rng = np.random.default_rng(2)
    errors, quantiles = [], []
    for _ in range(200):
        x = rng.normal(size=r)
        errors.append(estimates.quantile_mc_error(x, q))
        quantiles.append(np.quantile(x, q))
    empirical = float(np.std(quantiles, ddof=1))
    assert abs(np.median(errors) / theory - 1) < 0.15, (np.median(errors), theory)
    assert abs(empirical / theory - 1) < 0.15, (empirical, theory)


def test_bootstrap_ci_carries_mc_error_and_decimals():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 800)
    p = np.where(rng.random(800) < 0.8, y, 1 - y)
    ci = stats.bootstrap_ci(y, p, "accuracy", n_resamples=2000, seed=0)
    # Accuracy on 800 examples: bootstrap sd ~ sqrt(.8 * .2 / 800) = 0.0141; endpoint SE ~ 0.0141 * 0.0598 / 1.
    expected = math.sqrt(0.8 * 0.2 / 800) * math.sqrt(0.025 * 0.975 / 2000) / sps.norm.pdf(1.96)
    assert_near(
        [ci.mc_error_low, ci.mc_error_high],
        [expected, expected],
        0.5 * expected,
        "MC SE of endpoints",
    )
    # points: ~0.08 pp supports one decimal
    assert estimates.decimals_for_error(ci.mc_error_low * 100) == 1


def test_decimals_for_error():
    assert [estimates.decimals_for_error(s) for s in (0.05, 0.03, 0.004, 0.6, 6.0)] == [
        1,
        1,
        2,
        0,
        0,
    ]
    assert (
        estimates.decimals_for_error(0.0) == 4
        and estimates.decimals_for_error(float("nan"), 3) == 3
    )
