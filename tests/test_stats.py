"""workbench.stats: metrics against sklearn, bootstrap intervals with known answers, seed pairing."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import stats as sps
from sklearn.metrics import accuracy_score, cohen_kappa_score, f1_score

from workbench import stats


def assert_near(actual, expected, tol: float, what: str = "") -> None:
    """Fail with the max difference shown, so a failure says by how much."""
    a, e = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), f"{what}: nan positions differ: {a} vs {e}"
    diff = float(np.abs(a[~nan_a] - e[~nan_e]).max()) if (~nan_a).any() else 0.0
    assert diff <= tol, f"{what}: max |difference| {diff:.3g} > tolerance {tol:g} ({a} vs {e})"


def ordinal_predictions(
    rng: np.random.Generator, n: int, k: int = 5
) -> tuple[np.ndarray, np.ndarray]:
    """Labels and predictions off by at most one grade: a plausible ordinal classifier."""
    y = rng.integers(0, k, n)
    return y, np.clip(y + rng.integers(-1, 2, n), 0, k - 1)


def exact_accuracy(n: int, acc: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n binary examples of which exactly round(acc * n) are predicted right, in random order."""
    y = rng.integers(0, 2, n)
    wrong = rng.permutation(n)[: n - round(acc * n)]
    p = y.copy()
    p[wrong] = 1 - p[wrong]
    return y, p


# ---------------------------------------------------------------- metrics


def test_qwk_equals_sklearn_on_random_data():
    rng = np.random.default_rng(0)
    for trial in range(50):
        k = int(rng.integers(2, 8))
        n = int(rng.integers(5, 300))
        y, p = rng.integers(0, k, n), rng.integers(0, k, n)
        if trial % 2:  # correlated predictions too, not only chance-level ones
            p = np.clip(y + rng.integers(-1, 2, n), 0, k - 1)
        want = cohen_kappa_score(y, p, weights="quadratic", labels=np.arange(k))
        assert_near(stats.quadratic_weighted_kappa(y, p, k), want, 1e-12, f"QWK trial {trial}")
        # The vectorised confusion-count version used by the bootstrap must agree too.
        assert_near(
            stats.bootstrap_ci(y, p, "qwk", n_resamples=1, num_classes=k).estimate,
            want,
            1e-12,
            "vectorised QWK",
        )


def test_qwk_with_a_class_absent_keeps_ordinal_positions():
    y, p = np.array([0, 0, 2, 2, 4]), np.array([0, 2, 2, 4, 4])  # classes 1 and 3 never occur
    assert_near(
        stats.quadratic_weighted_kappa(y, p, 5),
        cohen_kappa_score(y, p, weights="quadratic"),
        1e-12,
        "QWK",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn rightly warns that kappa is undefined here
        # nan, not a crash
        assert math.isnan(stats.quadratic_weighted_kappa(np.zeros(4, int), np.zeros(4, int), 3))


def test_classification_metrics_match_sklearn_and_handle_absent_class():
    rng = np.random.default_rng(1)
    y, p = ordinal_predictions(rng, 500, k=5)
    m = stats.classification_metrics(y, p, num_classes=6)  # class 5 absent from both sides
    assert m["n"] == 500
    assert_near(m["accuracy"], accuracy_score(y, p), 1e-12, "accuracy")
    assert_near(
        m["macro_f1"],
        f1_score(y, p, average="macro"),
        1e-12,
        "macro F1 leaves the absent class out",
    )
    cm = m["confusion_matrix"]
    assert cm.shape == (6, 6) and cm.sum() == 500 and cm[5].sum() == 0 and cm[:, 5].sum() == 0
    want_recall = np.append(np.diag(cm)[:5] / cm[:5].sum(axis=1), np.nan)
    assert_near(m["per_class_recall"], want_recall, 1e-12, "per-class recall")
    assert_near(m["qwk"], cohen_kappa_score(y, p, weights="quadratic"), 1e-12, "QWK")


def test_vectorised_metrics_equal_their_callable_versions():
    """Named metrics and sklearn callables see the same resamples, so give the same CI."""
    rng = np.random.default_rng(2)
    y, p = ordinal_predictions(rng, 120, k=4)
    p[:3] = 3  # a rare class, so some resamples lack it
    callables = {
        "accuracy": accuracy_score,
        "macro_f1": lambda a, b: f1_score(
            a, b, labels=range(4), average="macro", zero_division=np.nan
        ),
        "qwk": lambda a, b: cohen_kappa_score(a, b, labels=range(4), weights="quadratic"),
    }
    for name, fn in callables.items():
        fast = stats.bootstrap_ci(y, p, name, n_resamples=200, seed=5, num_classes=4)
        slow = stats.bootstrap_ci(y, p, fn, n_resamples=200, seed=5, num_classes=4)
        assert_near(
            [fast.estimate, fast.low, fast.high], [slow.estimate, slow.low, slow.high], 1e-12, name
        )


@pytest.mark.parametrize(
    "labels, predicted, num_classes, match",
    [
        ([0, 1, 2], [0, 1], 3, "equally long"),
        ([0, 1, 3], [0, 1, 2], 3, "labels contains class 3"),
        ([0, 1, 2], [0, -1, 2], 3, "predicted contains class -1"),
        ([0.0, 1.0], [0, 1], 2, "integer class indices"),
        ([], [], 2, "non-empty"),
    ],
)
def test_bad_inputs_get_clear_errors(labels, predicted, num_classes, match):
    with pytest.raises(ValueError, match=match):
        stats.classification_metrics(np.array(labels), np.array(predicted), num_classes)


def test_unknown_metric_name_is_an_error():
    with pytest.raises(ValueError, match="unknown metric 'kappa'"):
        stats.bootstrap_ci([0, 1], [0, 1], "kappa")


# ---------------------------------------------------------------- bootstrap over examples


def test_bootstrap_accuracy_matches_known_answer():
    n, acc = 10_000, 0.8
    y, p = exact_accuracy(n, acc, np.random.default_rng(3))
    ci = stats.bootstrap_ci(y, p, "accuracy", seed=0)
    assert ci.estimate == acc and ci.n_resamples == 1000 and ci.n_undefined == 0
    assert ci.method == "percentile bootstrap over examples"
    assert ci.low < acc < ci.high
    normal_width = 2 * 1.959964 * math.sqrt(acc * (1 - acc) / n)
    rel = abs((ci.high - ci.low) - normal_width) / normal_width
    assert rel <= 0.15, (
        f"CI width {ci.high - ci.low:.5f} vs normal approximation {normal_width:.5f}: {rel:.1%} apart"
    )
    # Centred near the estimate: each side within 15% of half the normal width.
    assert_near(
        [acc - ci.low, ci.high - acc], [normal_width / 2] * 2, 0.15 * normal_width / 2, "CI halves"
    )


def test_bootstrap_width_shrinks_with_n():
    rng = np.random.default_rng(4)
    widths = []
    for n in (100, 1_000, 10_000):
        ci = stats.bootstrap_ci(*exact_accuracy(n, 0.8, rng), "accuracy", seed=1)
        widths.append(ci.high - ci.low)
    assert widths[0] > widths[1] > widths[2], f"widths {widths} should shrink with n"
    # Width goes as 1/sqrt(n): 10x the examples, about 1/sqrt(10) the width.
    assert_near(widths[1] / widths[0], 10**-0.5, 0.08, "width ratio n=1000/n=100")
    assert_near(widths[2] / widths[1], 10**-0.5, 0.08, "width ratio n=10000/n=1000")


def test_bootstrap_is_deterministic_given_seed():
    y, p = ordinal_predictions(np.random.default_rng(5), 300)
    for metric in ("qwk", lambda a, b: float(np.mean(a == b))):
        first = stats.bootstrap_ci(y, p, metric, n_resamples=300, seed=7)
        assert first == stats.bootstrap_ci(y, p, metric, n_resamples=300, seed=7)
        assert first == stats.bootstrap_ci(
            y, p, metric, n_resamples=300, seed=np.random.default_rng(7)
        )
        assert first != stats.bootstrap_ci(y, p, metric, n_resamples=300, seed=8)


def test_paired_bootstrap_of_identical_predictions_is_exactly_zero():
    y, p = ordinal_predictions(np.random.default_rng(6), 400)
    for metric in ("accuracy", "macro_f1", "qwk", lambda a, b: float(np.mean(a == b))):
        ci = stats.paired_bootstrap_difference(y, p, p.copy(), metric, seed=3)
        assert (ci.estimate, ci.low, ci.high) == (0.0, 0.0, 0.0), f"{metric}: {ci}"


def test_paired_bootstrap_is_narrower_than_unpaired_for_correlated_arms():
    rng = np.random.default_rng(7)
    y, pa = ordinal_predictions(rng, 2_000)
    pb = pa.copy()
    flip = rng.permutation(y.size)[:100]  # b differs from a on 5% of examples only
    pb[flip] = y[flip]
    paired = stats.paired_bootstrap_difference(y, pa, pb, "accuracy", seed=0)
    want = accuracy_score(y, pa) - accuracy_score(y, pb)
    assert_near(paired.estimate, want, 1e-12, "paired estimate")
    single = stats.bootstrap_ci(y, pa, "accuracy", seed=0)
    assert paired.high - paired.low < 0.5 * (single.high - single.low)
    assert paired.high < 0  # b fixed errors only, so a - b is clearly negative


# ---------------------------------------------------------------- across seeds


def test_summarize_over_seeds():
    s = stats.summarize_over_seeds({2: 0.7, 0: 0.9, 1: 0.8})
    assert s["seeds"] == [0, 1, 2] and s["values"] == [0.9, 0.8, 0.7] and s["n"] == 3
    assert_near([s["mean"], s["std"]], [0.8, 0.1], 1e-12, "mean, std")
    one = stats.summarize_over_seeds({5: 0.5})
    assert one["mean"] == 0.5 and one["n"] == 1 and math.isnan(one["std"])
    with pytest.raises(ValueError, match=r"seed\(s\) \[1\]"):
        stats.summarize_over_seeds({0: 0.5, 1: float("nan")})


def test_paired_seed_comparison_equals_hand_computation():
    a = {0: 0.81, 1: 0.79, 2: 0.84, 3: 0.80, 4: 0.78}
    b = {0: 0.78, 1: 0.80, 2: 0.80, 3: 0.80, 4: 0.75}
    d = np.array([0.03, -0.01, 0.04, 0.0, 0.03])
    c = stats.paired_seed_comparison(a, b)
    assert c.seeds == [0, 1, 2, 3, 4] and c.n == 5
    assert_near(c.differences, d, 1e-12, "per-seed differences")
    mean, sd = d.mean(), d.std(ddof=1)
    half = sps.t.ppf(0.975, df=4) * sd / math.sqrt(5)
    assert_near(
        [c.mean_difference, c.ci_low, c.ci_high],
        [mean, mean - half, mean + half],
        1e-12,
        "mean, t-interval",
    )
    assert_near(
        c.p_value, sps.ttest_rel(list(a.values()), list(b.values())).pvalue, 1e-12, "t-test p"
    )
    t_stat = mean / (sd / math.sqrt(5))
    assert_near(c.p_value, 2 * sps.t.sf(abs(t_stat), df=4), 1e-12, "t-test p by hand")
    assert (c.wins, c.ties, c.losses) == (3, 1, 1)
    assert c.won == "won in 3 of 5 seeds (1 tied)"
    assert 0 < c.wilcoxon_p_value <= 1
    assert "scipy.stats.t" in c.method and "ttest_rel" in c.method and c.note == ""


def test_paired_seed_comparison_refuses_missing_seeds():
    a, b = {0: 0.8, 1: 0.9, 2: 0.7}, {0: 0.7, 1: 0.8, 3: 0.6}
    with pytest.raises(ValueError, match=r"missing in ours: \[3\], missing in baseline: \[2\]"):
        stats.paired_seed_comparison(a, b, names=("ours", "baseline"))
    c = stats.paired_seed_comparison(a, b, allow_missing=True)
    assert c.seeds == [0, 1] and c.missing_in_a == [3] and c.missing_in_b == [2]
    assert "2 shared seeds" in c.note
    with pytest.raises(ValueError, match="no seed in common"):
        stats.paired_seed_comparison({0: 1.0}, {1: 1.0}, allow_missing=True)


def test_paired_seed_comparison_degenerate_cases_say_why():
    one = stats.paired_seed_comparison({0: 0.9}, {0: 0.8})
    assert_near(one.mean_difference, 0.1, 1e-12, "n=1 mean")
    assert math.isnan(one.p_value) and math.isnan(one.ci_low) and "fewer than 2 seeds" in one.note
    same = stats.paired_seed_comparison({0: 0.5, 1: 0.5}, {0: 0.25, 1: 0.25})
    assert (same.ci_low, same.ci_high, same.mean_difference) == (0.25, 0.25, 0.25)
    assert math.isnan(same.p_value) and "same difference" in same.note


def test_hierarchical_bootstrap():
    rng = np.random.default_rng(9)
    per_a, per_b = {}, {}
    for s in range(4):
        y, pa = ordinal_predictions(rng, 300)
        pb = pa.copy()
        fix = rng.permutation(300)[:30]
        pb[fix] = y[fix]
        per_a[s], per_b[s] = (y, pa), (y.copy(), pb)
    ci = stats.paired_hierarchical_bootstrap(per_a, per_b, "accuracy", n_resamples=500, seed=0)
    want = np.mean([accuracy_score(*per_a[s]) - accuracy_score(*per_b[s]) for s in range(4)])
    assert_near(ci.estimate, want, 1e-12, "seed-mean difference")
    assert ci.low <= ci.estimate <= ci.high < 0 and ci.n_resamples == 500
    assert ci == stats.paired_hierarchical_bootstrap(
        per_a, per_b, "accuracy", n_resamples=500, seed=0
    )
    same = stats.paired_hierarchical_bootstrap(per_a, per_a, "qwk", n_resamples=200, seed=0)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)


def test_hierarchical_bootstrap_refuses_unpaired_input():
    y, p = ordinal_predictions(np.random.default_rng(10), 50)
    other = y.copy()
    other[0] = (other[0] + 1) % 5
    with pytest.raises(
        ValueError, match="seed 0: the arms were not evaluated on identical examples"
    ):
        stats.paired_hierarchical_bootstrap({0: (y, p)}, {0: (other, p)}, "accuracy")
    with pytest.raises(ValueError, match=r"missing in b: \[1\]"):
        stats.paired_hierarchical_bootstrap({0: (y, p), 1: (y, p)}, {0: (y, p)}, "accuracy")
