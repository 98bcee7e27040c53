"""Statistics for study reports: classification metrics, bootstrap intervals, seed-paired tests.

Two sources of chance matter in the studies. Which test examples were drawn is handled by
bootstrapping examples; which training seed ran is handled by pairing arms on the seed (a
seed fixes split and data order for every arm) and treating seeds as the replicates.

Every function is deterministic given its ``seed`` (an int or a ``numpy.random.Generator``).
A metric is a callable ``f(labels, predicted) -> float`` or a name in ``CONFUSION_METRICS``.
Named metrics are computed from per-resample confusion counts in one vectorised pass;
callables run once per resample. Both see the same resample indices for the same seed, so
they give the same interval.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
from scipy import stats as sps
from sklearn.exceptions import UndefinedMetricWarning
from sklearn.metrics import (
    accuracy_score,
    cohen_kappa_score,
    confusion_matrix,
    f1_score,
    recall_score,
)

from workbench.estimates import percentile_mc_errors

Metric = Union[str, Callable[[np.ndarray, np.ndarray], float]]
Seed = Union[int, np.random.Generator, None]

BOOTSTRAP_METHOD = "percentile bootstrap over examples"
PAIRED_BOOTSTRAP_METHOD = (
    "paired percentile bootstrap over examples (same resampled indices for both arms), a - b"
)
HIERARCHICAL_METHOD = (
    "hierarchical paired percentile bootstrap: seeds resampled with replacement, then examples within "
    "each drawn seed (fresh draw per drawn copy, same indices for both arms); mean over seeds of a - b"
)
INTERACTION_METHOD = (
    "hierarchical percentile bootstrap of an interaction: seeds resampled with replacement, then examples within "
    "each drawn seed (fresh draw per drawn copy, same indices for all four arms); mean over seeds of (a - b) - (c - d)"
)
# Bounds one block of resample indices (int64) to about 32 MB, whatever the test-set size.
_MAX_INDEX_ENTRIES = 4_000_000


@dataclass(frozen=True)
class CI:
    """A point estimate on the full data with a bootstrap confidence interval."""

    estimate: float
    low: float
    high: float
    n_resamples: int
    method: str = BOOTSTRAP_METHOD  # in words, for report footnotes
    confidence: float = 0.95
    # Resamples where the metric was undefined (nan), left out of the percentiles; kept so
    # an interval resting on fewer resamples than asked for is visible.
    n_undefined: int = 0
    # Monte-Carlo SEs of the endpoints (workbench.estimates.quantile_mc_error):
    # how many decimals of low/high the number of resamples supports.
    mc_error_low: float = field(default=float("nan"), compare=False)
    mc_error_high: float = field(default=float("nan"), compare=False)


@dataclass(frozen=True)
class PairedComparison:
    """Arm a against arm b over training seeds; each seed is a matched pair, ``a - b`` the data.

    ``p_value`` is the paired t-test, ``wilcoxon_p_value`` the signed-rank test (no normality
    assumption); they and the t-interval are nan when undefined, with the reason in ``note``.
    ``missing_in_a`` / ``missing_in_b`` can be non-empty only under ``allow_missing=True``.
    """

    seeds: list  # sorted
    differences: list[float]  # a - b, in the order of seeds
    n: int
    mean_difference: float
    ci_low: float  # Student-t interval of the mean difference
    ci_high: float
    confidence: float
    wins: int  # seeds with a > b
    ties: int
    losses: int
    p_value: float
    wilcoxon_p_value: float
    method: str
    note: str = ""
    missing_in_a: list = field(default_factory=list)
    missing_in_b: list = field(default_factory=list)

    @property
    def won(self) -> str:
        """'won in k of n seeds', naming ties when there are any."""
        ties = f" ({self.ties} tied)" if self.ties else ""
        return f"won in {self.wins} of {self.n} seeds{ties}"


# ---------------------------------------------------------------- metrics on one prediction set


def _check_labels(
    labels: Any, predicted: Any, num_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate class-index arrays; returns them as int64 with K (inferred when num_classes is None)."""
    y, p = np.asarray(labels), np.asarray(predicted)
    if y.shape != p.shape or y.size == 0:
        raise ValueError(
            f"labels and predicted must be non-empty and equally long, got shapes {y.shape} and {p.shape}"
        )
    for name, a in (("labels", y), ("predicted", p)):
        if a.ndim != 1 or a.dtype.kind not in "iub":
            raise ValueError(
                f"{name} must be 1-D integer class indices, got shape {a.shape} dtype {a.dtype}"
            )
    y, p = y.astype(np.int64), p.astype(np.int64)
    k = int(max(y.max(), p.max())) + 1 if num_classes is None else int(num_classes)
    for name, a in (("labels", y), ("predicted", p)):
        if a.min() < 0 or a.max() >= k:
            bad = a[(a < 0) | (a >= k)][0]
            raise ValueError(f"{name} contains class {bad}, outside 0..{k - 1} (num_classes={k})")
    return y, p, k


def quadratic_weighted_kappa(labels: Any, predicted: Any, num_classes: int) -> float:
    """Cohen's kappa with quadratic weights (QWK), for ordinal grades.

    Args:
        labels: True class indices, shape (N,).
        predicted: Predicted class indices, shape (N,).
        num_classes: K; given to sklearn as ``labels=range(K)`` so a class absent from
            both arrays keeps its place on the ordinal scale.

    Returns:
        QWK in [-1, 1]; nan when undefined (all examples in one class on both sides).
    """
    y, p, k = _check_labels(labels, predicted, num_classes)
    return float(cohen_kappa_score(y, p, labels=np.arange(k), weights="quadratic"))


def classification_metrics(labels: Any, predicted: Any, num_classes: int) -> dict[str, Any]:
    """Accuracy, macro F1, per-class recall, QWK and the confusion matrix.

    A class absent from both labels and predictions has no F1 or recall: it is nan in
    ``per_class_recall`` and left out of the macro F1 rather than counted as 0, which
    would penalise a model for a class the evaluation set does not contain.

    Args:
        labels: True class indices, shape (N,).
        predicted: Predicted class indices, shape (N,).
        num_classes: K.

    Returns:
        Dict with ``n``, ``accuracy``, ``macro_f1``, ``per_class_recall`` (list of K),
        ``qwk`` and ``confusion_matrix`` ((K, K) ints, rows true, columns predicted).
    """
    y, p, k = _check_labels(labels, predicted, num_classes)
    classes = np.arange(k)
    recall = recall_score(y, p, labels=classes, average=None, zero_division=np.nan)
    return {
        "n": int(y.size),
        "accuracy": float(accuracy_score(y, p)),
        "macro_f1": float(f1_score(y, p, labels=classes, average="macro", zero_division=np.nan)),
        "per_class_recall": [float(r) for r in recall],
        "qwk": quadratic_weighted_kappa(y, p, k),
        "confusion_matrix": confusion_matrix(y, p, labels=classes),
    }


# ---------------------------------------- the same metrics from a batch of confusion matrices
# Each maps counts (R, K, K) to (R,) and equals its sklearn counterpart on every resample
# (tests hold them to 1e-12); this is what makes 1,000 resamples take milliseconds.


def _accuracy_cm(cm: np.ndarray) -> np.ndarray:
    return np.trace(cm, axis1=1, axis2=2) / cm.sum(axis=(1, 2))


def _macro_f1_cm(cm: np.ndarray) -> np.ndarray:
    tp = np.diagonal(cm, axis1=1, axis2=2)
    denom = cm.sum(axis=1) + cm.sum(axis=2)  # 2tp + fp + fn
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(denom > 0, 2 * tp / denom, np.nan)  # nan: class absent on both sides
    return np.nanmean(f1, axis=1)  # never all-nan: a resample has at least one example


def _qwk_cm(cm: np.ndarray) -> np.ndarray:
    k = cm.shape[1]
    w = (np.arange(k)[:, None] - np.arange(k)[None, :]) ** 2.0
    expected = (
        cm.sum(axis=2)[:, :, None] * cm.sum(axis=1)[:, None, :] / cm.sum(axis=(1, 2))[:, None, None]
    )
    num, den = (w * cm).sum(axis=(1, 2)), (w * expected).sum(axis=(1, 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, 1.0 - num / den, np.nan)


CONFUSION_METRICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "accuracy": _accuracy_cm,
    "macro_f1": _macro_f1_cm,
    "qwk": _qwk_cm,
}


def _check_args(metric: Metric | None, n_resamples: int, confidence: float) -> None:
    if isinstance(metric, str) and metric not in CONFUSION_METRICS:
        raise ValueError(
            f"unknown metric {metric!r}; names: {sorted(CONFUSION_METRICS)}, or pass f(labels, predicted)"
        )
    if metric is not None and not isinstance(metric, str) and not callable(metric):
        raise TypeError(
            f"metric must be a name in {sorted(CONFUSION_METRICS)} or a callable, got {metric!r}"
        )
    if int(n_resamples) < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _confusion_batch(y: np.ndarray, p: np.ndarray, k: int, idx: np.ndarray) -> np.ndarray:
    """Confusion counts (R, K, K) of the resamples ``idx`` (R, N), from one bincount."""
    r = idx.shape[0]
    # (R, N): flat cell, own K*K block per resample
    codes = (y * k + p)[idx] + (np.arange(r) * k * k)[:, None]
    return np.bincount(codes.ravel(), minlength=r * k * k).reshape(r, k, k).astype(np.float64)


def _score(y: np.ndarray, p: np.ndarray, metric: Metric, k: int) -> float:
    if callable(metric):
        return float(metric(y, p))
    return float(
        CONFUSION_METRICS[metric](_confusion_batch(y, p, k, np.arange(y.size)[None, :]))[0]
    )


def _difference(scores: list) -> Any:
    """a - b of two arms' scores (or a alone): the contrast of every paired interval here."""
    return scores[0] if len(scores) == 1 else scores[0] - scores[1]


def _interaction(scores: list) -> Any:
    """(a - b) - (c - d) of four arms' scores: a difference of differences."""
    return (scores[0] - scores[1]) - (scores[2] - scores[3])


def _resampled(
    rng: np.random.Generator,
    y: np.ndarray,
    preds: list[np.ndarray],
    metric: Metric,
    k: int,
    rows: int,
    contrast: Callable[[list], Any] = _difference,
) -> np.ndarray:
    """``contrast`` of the arms' metrics (``preds``: one array per arm) on ``rows`` example resamples: (rows,).

    Every arm is scored on the same resampled indices of each row.
    """
    out = np.empty(rows)
    block = max(1, _MAX_INDEX_ENTRIES // y.size)  # depends only on N, so the draws are reproducible
    with warnings.catch_warnings():
        # An undefined metric on a resample is expected and counted in n_undefined; one
        # warning per resample would bury everything else.
        warnings.simplefilter("ignore", UndefinedMetricWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        for start in range(0, rows, block):
            idx = rng.integers(0, y.size, size=(min(block, rows - start), y.size))  # (R, N)
            if isinstance(metric, str):
                v = contrast(
                    [CONFUSION_METRICS[metric](_confusion_batch(y, p, k, idx)) for p in preds]
                )
            else:
                v = np.array([contrast([metric(y[i], p[i]) for p in preds]) for i in idx])
            out[start : start + idx.shape[0]] = v
    return out


def _percentile_ci(estimate: float, values: np.ndarray, confidence: float, method: str) -> CI:
    defined = values[~np.isnan(values)]
    alpha = 1.0 - confidence
    low, high = (
        np.quantile(defined, [alpha / 2, 1 - alpha / 2]) if defined.size else (np.nan, np.nan)
    )
    mc_low, mc_high = percentile_mc_errors(defined, confidence)
    return CI(
        float(estimate),
        float(low),
        float(high),
        int(values.size),
        method,
        float(confidence),
        int(values.size - defined.size),
        mc_low,
        mc_high,
    )


# ------------------------------------------------------------------ bootstrap over examples


def bootstrap_ci(
    labels: Any,
    predicted: Any,
    metric_fn: Metric,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: Seed = 0,
    num_classes: int | None = None,
) -> CI:
    """Percentile bootstrap CI of a metric, resampling examples with replacement.

    Args:
        labels: True class indices, shape (N,).
        predicted: Predicted class indices, shape (N,).
        metric_fn: A name in ``CONFUSION_METRICS`` (vectorised) or ``f(labels, predicted)``.
        n_resamples: Bootstrap resamples.
        confidence: Two-sided level.
        seed: Seed or Generator for the resample indices.
        num_classes: K; inferred from the data when omitted (no named metric changes when
            a class is absent, so inference is safe for them).

    Returns:
        The CI; ``estimate`` is the metric on all N examples.
    """
    y, p, k = _check_labels(labels, predicted, num_classes)
    _check_args(metric_fn, n_resamples, confidence)
    values = _resampled(np.random.default_rng(seed), y, [p], metric_fn, k, int(n_resamples))
    return _percentile_ci(_score(y, p, metric_fn, k), values, confidence, BOOTSTRAP_METHOD)


def paired_bootstrap_difference(
    labels: Any,
    pred_a: Any,
    pred_b: Any,
    metric_fn: Metric,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: Seed = 0,
    num_classes: int | None = None,
) -> CI:
    """CI of ``metric(a) - metric(b)`` for two prediction sets on the same examples.

    Both arms are scored on the same resampled indices, so what the examples contribute
    to both cancels (e.g. transfer regimes on one test set).

    Args:
        labels: True class indices, shape (N,).
        pred_a: Arm a's predictions, shape (N,).
        pred_b: Arm b's predictions, shape (N,).
        metric_fn, n_resamples, confidence, seed, num_classes: As in ``bootstrap_ci``.

    Returns:
        The CI of a - b.
    """
    y, pa, ka = _check_labels(labels, pred_a, num_classes)
    _, pb, kb = _check_labels(labels, pred_b, num_classes)
    _check_args(metric_fn, n_resamples, confidence)
    k = max(ka, kb)
    values = _resampled(np.random.default_rng(seed), y, [pa, pb], metric_fn, k, int(n_resamples))
    estimate = _score(y, pa, metric_fn, k) - _score(y, pb, metric_fn, k)
    return _percentile_ci(estimate, values, confidence, PAIRED_BOOTSTRAP_METHOD)


# ------------------------------------------------------------------------ across seeds


def _sorted_seeds(seeds: Any) -> list:
    try:
        return sorted(seeds)
    except TypeError:  # mixed key types (e.g. 0 and "0" from MLflow params): still deterministic
        return sorted(seeds, key=repr)


def _pair_seeds(
    a: Mapping, b: Mapping, allow_missing: bool, names: tuple[str, str]
) -> tuple[list, list, list]:
    """Shared seeds, seeds missing in a, seeds missing in b; refuses a silent partial pairing."""
    missing_in_a, missing_in_b = _sorted_seeds(set(b) - set(a)), _sorted_seeds(set(a) - set(b))
    common = _sorted_seeds(set(a) & set(b))
    if (missing_in_a or missing_in_b) and not allow_missing:
        raise ValueError(
            f"seeds differ between arms: missing in {names[0]}: {missing_in_a}, missing in {names[1]}: {missing_in_b}. "
            f"Refusing to compare silently on the {len(common)} shared seeds; finish the missing runs or pass "
            "allow_missing=True to compare the shared seeds and report the rest"
        )
    if not common:
        raise ValueError(
            f"no seed in common: {names[0]} has {_sorted_seeds(a)}, {names[1]} has {_sorted_seeds(b)}"
        )
    return common, missing_in_a, missing_in_b


def _finite_values(values: Mapping, seeds: list, name: str) -> np.ndarray:
    v = np.array([float(values[s]) for s in seeds])
    bad = [s for s, x in zip(seeds, v) if not np.isfinite(x)]
    if bad:
        raise ValueError(f"{name}: non-finite value for seed(s) {bad}: {[values[s] for s in bad]}")
    return v


def summarize_over_seeds(values: Mapping[Any, float]) -> dict[str, Any]:
    """Mean and spread of one metric over training seeds.

    Args:
        values: Seed -> metric value.

    Returns:
        Dict with ``mean``, ``std`` (sample std, ddof=1; nan for one seed), ``n``,
        ``seeds`` (sorted) and ``values`` (in the order of ``seeds``).
    """
    if not values:
        raise ValueError("no values to summarize")
    seeds = _sorted_seeds(values)
    v = _finite_values(values, seeds, "values")
    std = float(v.std(ddof=1)) if v.size > 1 else float("nan")
    return {
        "mean": float(v.mean()),
        "std": std,
        "n": int(v.size),
        "seeds": seeds,
        "values": v.tolist(),
    }


def paired_seed_comparison(
    a: Mapping[Any, float],
    b: Mapping[Any, float],
    confidence: float = 0.95,
    allow_missing: bool = False,
    names: tuple[str, str] = ("a", "b"),
) -> PairedComparison:
    """Compare two arms seed by seed: each seed is a matched pair, the differences are the data.

    Args:
        a: Seed -> metric of arm a.
        b: Seed -> metric of arm b.
        confidence: Two-sided level of the t-interval.
        allow_missing: Without it, seeds present in only one arm raise ``ValueError`` listing
            them; with it, the shared seeds are compared and the rest reported in the result.
        names: Arm names for messages and ``method``.

    Returns:
        The comparison of a - b.
    """
    _check_args(None, 1, confidence)
    seeds, missing_in_a, missing_in_b = _pair_seeds(a, b, allow_missing, names)
    va, vb = _finite_values(a, seeds, names[0]), _finite_values(b, seeds, names[1])
    d = va - vb
    n, mean = d.size, float(d.mean())
    notes = []
    if missing_in_a or missing_in_b:
        notes.append(
            f"compared on {n} shared seeds; missing in {names[0]}: {missing_in_a}, in {names[1]}: {missing_in_b}"
        )
    low = high = p = w = float("nan")
    if n < 2:
        notes.append("fewer than 2 seeds: no spread to estimate, so no t-interval or p-values")
    elif np.allclose(d, d[0], rtol=1e-9, atol=1e-12):
        # Zero spread (up to float noise such as 0.9 - 0.8 vs 0.8 - 0.7): scipy's t-interval
        # needs scale > 0, and the t statistic would be 0/0 or a meaningless huge number.
        low = high = mean
        notes.append("every seed has the same difference: zero-width interval, t-test undefined")
    else:
        low, high = (
            float(x) for x in sps.t.interval(confidence, n - 1, loc=mean, scale=sps.sem(d))
        )
        p = float(sps.ttest_rel(va, vb).pvalue)
    if n >= 2 and np.any(d != 0):
        with warnings.catch_warnings():
            # scipy warns when ties or zeros force the normal approximation
            warnings.simplefilter("ignore")
            w = float(sps.wilcoxon(d).pvalue)
    method = (
        f"paired over seeds, d = {names[0]} - {names[1]} per seed; mean d with {confidence:.0%} Student-t interval "
        "(scipy.stats.t, df = n - 1); two-sided paired t-test (scipy.stats.ttest_rel) and Wilcoxon signed-rank "
        "(scipy.stats.wilcoxon); wins/ties/losses count seeds with d > 0 / = 0 / < 0"
    )
    return PairedComparison(
        seeds=seeds,
        differences=d.tolist(),
        n=int(n),
        mean_difference=mean,
        ci_low=low,
        ci_high=high,
        confidence=float(confidence),
        wins=int((d > 0).sum()),
        ties=int((d == 0).sum()),
        losses=int((d < 0).sum()),
        p_value=p,
        wilcoxon_p_value=w,
        method=method,
        note="; ".join(notes),
        missing_in_a=missing_in_a,
        missing_in_b=missing_in_b,
    )


def paired_hierarchical_bootstrap(
    per_seed_a: Mapping[Any, tuple[Any, Any]],
    per_seed_b: Mapping[Any, tuple[Any, Any]],
    metric_fn: Metric,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: Seed = 0,
    num_classes: int | None = None,
) -> CI:
    """CI of the seed-mean difference ``metric(a) - metric(b)`` from saved predictions.

    Both sources of chance enter: seeds are resampled, then examples within each drawn
    seed, with the same example indices for both arms. With few seeds (3-5) the seed level
    of any bootstrap is narrow by about sqrt((n - 1) / n); read it beside the t-interval of
    ``paired_seed_comparison``.

    Args:
        per_seed_a: Seed -> (labels, predicted) of arm a.
        per_seed_b: Seed -> (labels, predicted) of arm b. Labels must equal a's for every
            seed (same examples, same order): the pairing rests on it.
        metric_fn, n_resamples, confidence, seed, num_classes: As in ``bootstrap_ci``.

    Returns:
        The CI; ``estimate`` is the mean over seeds of the full-data difference.
    """
    return _hierarchical(
        [per_seed_a, per_seed_b],
        _difference,
        HIERARCHICAL_METHOD,
        metric_fn,
        n_resamples,
        confidence,
        seed,
        num_classes,
    )


def hierarchical_interaction_bootstrap(
    per_seed: Sequence[Mapping[Any, tuple[Any, Any]]],
    metric_fn: Metric,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: Seed = 0,
    num_classes: int | None = None,
) -> CI:
    """CI of the seed-mean interaction ``(metric(a) - metric(b)) - (metric(c) - metric(d))``.

    The same hierarchical bootstrap as ``paired_hierarchical_bootstrap`` (seeds resampled,
    then examples within each drawn seed), with one seed draw and one example draw shared
    by all four arms, so what a seed or an example contributes to every arm cancels.

    Args:
        per_seed: Four mappings, seed -> (labels, predicted), of arms a, b, c, d: the same
            seeds, and for every seed the same labels in the same order in all four.
        metric_fn, n_resamples, confidence, seed, num_classes: As in ``bootstrap_ci``.

    Returns:
        The CI; ``estimate`` is the mean over seeds of the full-data interaction.
    """
    if len(per_seed) != 4:
        raise ValueError(f"an interaction needs 4 arms (a, b, c, d), got {len(per_seed)}")
    return _hierarchical(
        list(per_seed),
        _interaction,
        INTERACTION_METHOD,
        metric_fn,
        n_resamples,
        confidence,
        seed,
        num_classes,
    )


def _hierarchical(
    per_seed: list[Mapping],
    contrast: Callable[[list], Any],
    method: str,
    metric_fn: Metric,
    n_resamples: int,
    confidence: float,
    seed: Seed,
    num_classes: int | None,
) -> CI:
    """The hierarchical bootstrap of ``contrast`` over the arms of ``per_seed`` (see its callers)."""
    _check_args(metric_fn, n_resamples, confidence)
    names = ("a", "b", "c", "d")[: len(per_seed)]
    seeds, _, _ = _pair_seeds(per_seed[0], per_seed[1], False, names[:2])
    for name, arm in zip(names[2:], per_seed[2:]):
        if set(arm) != set(seeds):
            raise ValueError(
                f"seeds differ between arms: {names[0]} has {seeds}, {name} has {_sorted_seeds(arm)}"
            )
    data, k = [], 0
    for s in seeds:
        checked = [_check_labels(*arm[s], num_classes) for arm in per_seed]
        y0 = checked[0][0]
        for name, (y, _, _) in zip(names[1:], checked[1:]):
            if y.shape != y0.shape or not np.array_equal(y, y0):
                how = (
                    f"{y0.size} vs {y.size} examples"
                    if y.shape != y0.shape
                    else f"{int((y0 != y).sum())} labels differ"
                )
                who = "the arms were" if len(per_seed) == 2 else f"arms {names[0]} and {name} were"
                raise ValueError(
                    f"seed {s!r}: {who} not evaluated on identical examples ({how}); "
                    "a paired bootstrap needs the same labels in the same order"
                )
        data.append((y0, [p for _, p, _ in checked]))
        k = max(k, *(kk for _, _, kk in checked))
    rng = np.random.default_rng(seed)
    r, n_seeds = int(n_resamples), len(seeds)
    pick = rng.integers(0, n_seeds, size=r * n_seeds)  # flat (R, S): which seed fills each slot
    slot_diff = np.empty(r * n_seeds)
    for j, (y, preds) in enumerate(data):
        # every drawn copy of seed j gets its own example resample
        slots = np.flatnonzero(pick == j)
        slot_diff[slots] = _resampled(rng, y, preds, metric_fn, k, slots.size, contrast)
    values = slot_diff.reshape(r, n_seeds).mean(axis=1)
    estimate = float(
        np.mean([contrast([_score(y, p, metric_fn, k) for p in preds]) for y, preds in data])
    )
    return _percentile_ci(estimate, values, confidence, method)


def fisher_z_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean of correlations, taken on Fisher's z and mapped back.

    Each correlation ``r`` becomes ``z = artanh(r)`` (clipped to ``|r| <= 1 - 1e-12``); the
    t-interval of the mean ``z`` (df = n - 1) is mapped back by ``tanh``, so the interval of
    a correlation stays inside [-1, 1] however few the values (a raw t-interval does not).

    Returns:
        (low, high); NaN for fewer than two finite values, the value itself twice when every
        value is the same.
    """
    _check_args(None, 1, confidence)
    r = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if r.size < 2:
        return float("nan"), float("nan")
    z = np.arctanh(np.clip(r, -1 + 1e-12, 1 - 1e-12))
    if np.allclose(z, z[0], rtol=1e-9, atol=1e-12):
        return float(np.tanh(z[0])), float(np.tanh(z[0]))
    low, high = sps.t.interval(confidence, z.size - 1, loc=z.mean(), scale=sps.sem(z))
    return float(np.tanh(low)), float(np.tanh(high))
