"""Numbers a report states beside its comparisons, and how far each can be trusted.

- ``mean_interval``: an arm's mean over seeds with a Student-t interval.
- ``paired_effect_size``: mean difference over the sd of differences (d_z) with an exact
  noncentral-t interval, the small-sample corrected g_z, and a caveat in words.
- ``min_wilcoxon_p`` and ``bootstrap_seed_multisets``: how fine the seed-level tests can
  be at all with n seeds (the resolution a reader needs before reading a p or an interval).
- ``quantile_mc_error`` / ``percentile_mc_errors`` / ``decimals_for_error``: the
  Monte-Carlo standard error of bootstrap percentile endpoints, and the decimals it supports.

Pure numpy/scipy: ``workbench.stats`` imports this module to attach the Monte-Carlo
error to every bootstrap interval it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize, special
from scipy import stats as sps

Z95 = float(sps.norm.ppf(0.975))


@dataclass(frozen=True)
class MeanInterval:
    """Mean over seeds with its Student-t interval (nan bounds and a note when undefined)."""

    mean: float
    low: float
    high: float
    n: int
    sd: float  # sample sd, ddof=1
    confidence: float
    note: str = ""


@dataclass(frozen=True)
class EffectSize:
    """Standardised paired difference d_z = mean(d) / sd(d) over seeds.

    ``low``/``high`` are the exact interval of d_z (noncentral t, df = n - 1); ``g_z`` is
    d_z times Hedges' small-sample correction J(df), which removes its upward bias.
    """

    d_z: float
    g_z: float
    low: float
    high: float
    n: int
    mean_difference: float
    sd_difference: float
    confidence: float
    caveat: str


def _finite(values: Any, what: str) -> np.ndarray:
    v = np.asarray(
        list(values.values()) if isinstance(values, dict) else values, dtype=np.float64
    ).ravel()
    if v.size == 0:
        raise ValueError(f"{what}: no values")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{what}: non-finite value(s) {v[~np.isfinite(v)].tolist()}")
    return v


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def mean_interval(values: Any, confidence: float = 0.95) -> MeanInterval:
    """An arm's mean accuracy over seeds with a two-sided Student-t interval (df = n - 1).

    Args:
        values: Per-seed values (a sequence, or a seed -> value mapping).
        confidence: Two-sided level.

    Returns:
        The interval; with one seed, or seeds that all agree, the bounds are nan or equal to
        the mean and ``note`` says why (a zero-width interval is not a certainty).
    """
    _check_confidence(confidence)
    v = _finite(values, "mean_interval")
    n, mean = int(v.size), float(v.mean())
    if n < 2:
        return MeanInterval(
            mean, math.nan, math.nan, n, math.nan, confidence, "one seed: no spread, no interval"
        )
    sd = float(v.std(ddof=1))
    if sd <= 1e-12 * max(1.0, abs(mean)):
        return MeanInterval(
            mean,
            mean,
            mean,
            n,
            sd,
            confidence,
            f"all {n} seeds give the same value: zero-width interval, not a certainty",
        )
    half = float(sps.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return MeanInterval(mean, mean - half, mean + half, n, sd, confidence)


def hedges_j(df: int) -> float:
    """Exact small-sample bias correction of a standardised mean, J(df) = G(df/2) / (sqrt(df/2) G((df-1)/2))."""
    if df < 2:
        return math.nan  # J(1) is 0: the correction is undefined with two seeds
    return float(
        math.exp(special.gammaln(df / 2) - special.gammaln((df - 1) / 2)) / math.sqrt(df / 2)
    )


def _nct_bound(t_obs: float, df: int, target: float) -> float:
    """Noncentrality nc with P(T <= t_obs | nc) = target (the cdf falls as nc grows).

    nan where scipy's noncentral t cannot be evaluated (t statistics in the thousands,
    i.e. nearly identical differences): no interval rather than a wrong one.
    """
    f = lambda nc: sps.nct.cdf(t_obs, df, nc) - target  # noqa: E731
    lo, hi = t_obs - 10.0, t_obs + 10.0
    try:
        for _ in range(20):
            if not f(lo) < 0:
                break
            lo -= 10.0 * (hi - lo)
        for _ in range(20):
            if not f(hi) > 0:
                break
            hi += 10.0 * (hi - lo)
        flo, fhi = f(lo), f(hi)
        if not (np.isfinite(flo) and np.isfinite(fhi) and flo >= 0 >= fhi):
            return math.nan
        return float(optimize.brentq(f, lo, hi, xtol=1e-12, rtol=1e-12))
    except (ValueError, RuntimeError, FloatingPointError):
        return math.nan


def paired_effect_size(differences: Any, confidence: float = 0.95) -> EffectSize:
    """Effect size of a seed-paired comparison: mean difference over the sd of differences.

    Args:
        differences: Per-seed differences a - b.
        confidence: Level of the noncentral-t interval of d_z.

    Returns:
        The effect size; nan where undefined (fewer than 2 seeds, zero spread), with the
        reason in ``caveat``.
    """
    _check_confidence(confidence)
    d = _finite(differences, "paired_effect_size")
    n, mean = int(d.size), float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    nan = math.nan
    if n < 2:
        return EffectSize(
            nan,
            nan,
            nan,
            nan,
            n,
            mean,
            sd,
            confidence,
            "no effect size: one seed gives no spread of differences",
        )
    if sd <= 1e-12 * max(1.0, abs(mean)):
        return EffectSize(
            nan,
            nan,
            nan,
            nan,
            n,
            mean,
            sd,
            confidence,
            f"no effect size: all {n} seeds give the same difference (sd 0)",
        )
    dz = mean / sd
    t_obs, df = dz * math.sqrt(n), n - 1
    alpha = 1.0 - confidence
    low = _nct_bound(t_obs, df, 1 - alpha / 2) / math.sqrt(n)
    high = _nct_bound(t_obs, df, alpha / 2) / math.sqrt(n)
    if not (
        math.isfinite(low) and math.isfinite(high)
    ):  # half an interval from a failing solver: show none
        low = high = math.nan
    j = hedges_j(df)
    interval = (
        f"{confidence:.0%} interval {low:+.2f} to {high:+.2f}"
        if math.isfinite(low) and math.isfinite(high)
        else "its interval cannot be computed"
    )
    caveat = (
        f"d_z = mean difference / sd of the differences over {n} seeds. The sd rests on {df} degree"
        f"{'s' if df != 1 else ''} of freedom, so d_z is very imprecise ({interval}) and overstates the "
        "effect at small n"
        + (f" (bias-corrected g_z = {dz * j:+.2f})" if df >= 2 else "")
        + ". It compares the difference with seed-to-seed noise, not with the spread of examples, "
        "so it is not comparable with Cohen's d of other studies."
    )
    return EffectSize(
        float(dz), float(dz * j), float(low), float(high), n, mean, sd, confidence, caveat
    )


def min_wilcoxon_p(n: int, two_sided: bool = True) -> float:
    """Smallest p the exact Wilcoxon signed-rank test can give with n nonzero differences.

    All n differences of one sign is the most extreme of the 2^n equally likely sign
    patterns, so p >= 1/2^n one-sided and 2/2^n two-sided (0.25 for n = 3): below about
    6 seeds no result can reach p < 0.05.
    """
    if n < 1:
        return math.nan
    return min(1.0, (2.0 if two_sided else 1.0) / 2.0**n)


def bootstrap_seed_multisets(n: int) -> int:
    """Distinct seed multisets a seed-level bootstrap can draw from n seeds: C(2n - 1, n).

    Drawing n seeds with replacement, order irrelevant to the mean: 3 for 2 seeds, 10 for 3,
    35 for 4. However many resamples are drawn, the seed level takes only these values.
    """
    if n < 1:
        return 0
    return math.comb(2 * n - 1, n)


def quantile_mc_error(values: Any, q: float, z: float = Z95) -> float:
    """Monte-Carlo standard error of the q-quantile of ``values`` (bootstrap replicates).

    The rank of the sample q-quantile among R replicates is Binomial(R, q): sd sqrt(R q (1-q)).
    The values at ranks q(R-1) -/+ z of those sds bracket the quantile with about the
    confidence of z, so their distance over 2z estimates its SE without assuming a shape
    (the order-statistic method). nan values are left out, as in the percentiles.
    """
    v = np.sort(np.asarray(values, dtype=np.float64).ravel())
    v = v[~np.isnan(v)]
    r = v.size
    if r < 2 or not 0.0 < q < 1.0:
        return math.nan
    centre, spread = q * (r - 1), z * math.sqrt(r * q * (1 - q))
    lo, hi = max(0, math.floor(centre - spread)), min(r - 1, math.ceil(centre + spread))
    return float((v[hi] - v[lo]) / (2 * z))


def percentile_mc_errors(values: Any, confidence: float = 0.95) -> tuple[float, float]:
    """Monte-Carlo SEs of the low and high endpoints of a percentile interval."""
    _check_confidence(confidence)
    alpha = 1.0 - confidence
    return quantile_mc_error(values, alpha / 2), quantile_mc_error(values, 1 - alpha / 2)


def decimals_for_error(se: float, max_decimals: int = 4) -> int:
    """Decimals whose last digit is the first one Monte-Carlo noise touches: step 10^-d >= SE / 2.

    So the last shown digit is uncertain by one or two units and no digit after it is shown:
    an SE of 0.05 or 0.13 (points) gives 1 decimal (the second would be noise); 0.004
    gives 2; 0 or nan (no noise: an exact value) gives ``max_decimals``.
    """
    if not math.isfinite(se) or se <= 0:
        return max_decimals
    return int(min(max_decimals, max(0, math.floor(-math.log10(se / 2) + 1e-9))))
