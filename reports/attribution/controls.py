"""The controls of an attribution report, computed from the per-image arrays every cell logged.

- Against the random draws (``against_draws``): where a cell logged ``random_draws/<measure>``
  ``(D, N)``, a method is compared with the mean of the ``D`` draws per seed (t-interval over
  seeds of method - draws' mean; hierarchical bootstrap over seeds and images against each
  image's mean over the draws), and the draws' own spread is measured: the standard deviation
  of the ``D`` per-draw means within a seed, and the number of draws the method beats per seed.
- Method against method (``pairwise``): every pair of methods (the random order left out), per
  measure, the seed-paired t-interval and the hierarchical bootstrap of a - b.
- Per class (``per_class``): each method's rho and AUCs over the images of each true class,
  per seed; a sign that every seed agrees on (all seeds above zero, or all below) is a
  settled sign, and a method with settled signs both ways has its sign flip across classes.
- The sanity check (``sanity``): each map against itself on the randomised model
  (``workbench.attribution.controls``), per form (``cascade`` from the logits down, nested;
  ``independent`` one layer at a time) and metric (rho, absolute-value rho, SSIM), mean over
  images then seeds; rho at least ``SURVIVES`` with every layer random is flagged. Evidence
  from before the cascade (``sanity/<method>``: rho with the top blocks randomised, a fresh
  draw per step, head, final norm and embeddings trained) reads as form ``blocks``.
- The insertion start (``insertion_start``): the class each seed's model predicts from the
  class token alone, and with what probability.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from reports.attribution.faithfulness import (
    BASELINE,
    BETTER,
    MEASURES,
    per_image,
    seed_value,
    value_bootstrap,
)
from tracking.kinds.attribution_runs import AttributionCellResult
from workbench import stats
from workbench.attribution.controls import SANITY_METRICS, SANITY_MODES, SURVIVES

ORACLE = "oracle"


def _shared(a: dict[int, float], b: dict[int, float]) -> list[int]:
    """The seeds where both values are defined (rho is not for a constant map)."""
    return [s for s in sorted(a) if math.isfinite(a[s]) and math.isfinite(b.get(s, math.nan))]


def has_draws(cells: dict[int, AttributionCellResult]) -> bool:
    return all(f"random_draws/{m}" in c.arrays for c in cells.values() for m in MEASURES)


def has_sanity(cells: dict[int, AttributionCellResult]) -> bool:
    return sanity_form(cells) is not None


def sanity_form(cells: dict[int, AttributionCellResult]) -> str | None:
    """``cascade`` (Adebayo et al.'s check, both forms), ``blocks`` (evidence from before it), or None."""
    if all("sanity_layers" in c.arrays for c in cells.values()):
        return "cascade"
    if all(any(k.startswith("sanity/") for k in c.arrays) for c in cells.values()):
        return "blocks"
    return None


def sanity_layers(cells: dict[int, AttributionCellResult]) -> list[str]:
    """The step names: the cascade's layers from the logits down, or ``top j`` blocks for old evidence."""
    first = next(iter(cells.values()))
    if sanity_form(cells) == "cascade":
        return [str(v) for v in first.arrays["sanity_layers"]]
    depth = next(v for k, v in first.arrays.items() if k.startswith("sanity/")).shape[0]
    return [f"top {j}" for j in range(1, depth + 1)]


def has_start(cells: dict[int, AttributionCellResult]) -> bool:
    return all("insertion_start_predicted" in c.arrays for c in cells.values())


@dataclass(frozen=True)
class DrawComparison:
    """One method's measure against the random draws of the same cells and images."""

    method: str
    measure: str
    versus: stats.PairedComparison  # method - the draws' mean, per seed
    bootstrap: stats.CI  # method - each image's mean over the draws, seeds then images
    beats: dict[int, int]  # seed -> draws the method is more faithful than (of ``draws``)
    draws: int

    def settled(self) -> int:
        """+1: both intervals on the faithful side of zero; -1: both on the other; 0: neither."""
        t, b = self.versus, self.bootstrap
        if not (math.isfinite(t.ci_low) and t.ci_low != t.ci_high):
            return 0
        for side in (1.0, -1.0):
            if min(side * t.ci_low, side * t.ci_high) > 0 and min(side * b.low, side * b.high) > 0:
                return int(side * BETTER[self.measure])
        return 0


@dataclass(frozen=True)
class DrawSpread:
    """The random draws' own spread for one measure: per seed the draws' mean and SD of their means."""

    measure: str
    mean: dict[int, float]
    sd: dict[int, float]
    low: dict[int, float]
    high: dict[int, float]


def draw_means(cell: AttributionCellResult, measure: str) -> np.ndarray:
    """``(D,)`` each draw's mean over the images (rho: over the images where it is defined)."""
    return np.array([seed_value(row) for row in cell.arrays[f"random_draws/{measure}"]])


def draw_spread(cells: dict[int, AttributionCellResult]) -> list[DrawSpread]:
    out = []
    for measure in MEASURES:
        means = {s: draw_means(c, measure) for s, c in sorted(cells.items())}
        out.append(
            DrawSpread(
                measure,
                {s: float(v.mean()) for s, v in means.items()},
                {s: float(v.std(ddof=1)) if v.size > 1 else math.nan for s, v in means.items()},
                {s: float(v.min()) for s, v in means.items()},
                {s: float(v.max()) for s, v in means.items()},
            )
        )
    return out


def against_draws(
    cells: dict[int, AttributionCellResult], n_resamples: int, confidence: float, seed: int
) -> list[DrawComparison]:
    """Every method but ``random`` against the random draws, per measure."""
    methods = [m for m in next(iter(cells.values())).methods if m != BASELINE]
    out = []
    for measure in MEASURES:
        draws = {
            s: c.arrays[f"random_draws/{measure}"].astype(np.float64) for s, c in cells.items()
        }
        means = {s: draw_means(c, measure) for s, c in cells.items()}
        with np.errstate(all="ignore"):
            per_image_mean = {s: np.nanmean(d, axis=0) for s, d in draws.items()}  # (N,)
        for m in methods:
            images = {s: per_image(c, m, measure) for s, c in cells.items()}
            values = {s: seed_value(v) for s, v in images.items()}
            base = {
                s: float(np.nanmean(v)) if np.isfinite(v).any() else math.nan
                for s, v in means.items()
            }
            shared = _shared(values, base)
            if not shared:  # undefined in every seed (e.g. a constant map has no rho): no row
                continue
            versus = stats.paired_seed_comparison(
                {s: values[s] for s in shared},
                {s: base[s] for s in shared},
                confidence,
                names=(m, "random draws"),
            )
            boot = value_bootstrap(
                {s: images[s] for s in shared},
                {s: per_image_mean[s] for s in shared},
                n_resamples,
                confidence,
                seed,
            )
            beats = {s: int((BETTER[measure] * (values[s] - means[s]) > 0).sum()) for s in shared}
            out.append(
                DrawComparison(m, measure, versus, boot, beats, next(iter(means.values())).size)
            )
    return out


@dataclass(frozen=True)
class PairRow:
    a: str
    b: str
    measure: str
    versus: stats.PairedComparison  # a - b per seed
    bootstrap: stats.CI  # a - b, seeds then images


def pairwise(
    cells: dict[int, AttributionCellResult], n_resamples: int, confidence: float, seed: int
) -> list[PairRow]:
    """Every pair of methods (the random order left out: the draws are its comparison), per measure."""
    methods = [m for m in next(iter(cells.values())).methods if m != BASELINE]
    out = []
    for measure in MEASURES:
        images = {m: {s: per_image(c, m, measure) for s, c in cells.items()} for m in methods}
        values = {m: {s: seed_value(v) for s, v in images[m].items()} for m in methods}
        for a, b in itertools.combinations(methods, 2):
            shared = _shared(values[a], values[b])
            if not shared:  # one of them undefined in every seed: no row
                continue
            versus = stats.paired_seed_comparison(
                {s: values[a][s] for s in shared},
                {s: values[b][s] for s in shared},
                confidence,
                names=(a, b),
            )
            boot = value_bootstrap(
                {s: images[a][s] for s in shared},
                {s: images[b][s] for s in shared},
                n_resamples,
                confidence,
                seed,
            )
            out.append(PairRow(a, b, measure, versus, boot))
    return out


@dataclass(frozen=True)
class ClassRow:
    """One method's measure per true class: class -> seed -> the mean over that class's images."""

    method: str
    measure: str
    per_class: dict[int, dict[int, float]]

    def mean(self, c: int) -> float:
        finite = [v for v in self.per_class[c].values() if math.isfinite(v)]
        return float(np.mean(finite)) if finite else math.nan

    def sign(self, c: int) -> int:
        """+1 / -1 when every seed's value lies above / below zero, else 0."""
        v = np.array(list(self.per_class[c].values()))
        if v.size and np.all(v > 0):
            return 1
        if v.size and np.all(v < 0):
            return -1
        return 0

    def flips(self) -> tuple[list[int], list[int]] | None:
        """(classes settled above zero, classes settled below zero) when both are non-empty."""
        up = [c for c in self.per_class if self.sign(c) > 0]
        down = [c for c in self.per_class if self.sign(c) < 0]
        return (up, down) if up and down else None


def per_class(cells: dict[int, AttributionCellResult]) -> list[ClassRow]:
    """rho per class, and each AUC per class as method - random (the draws' mean where logged)."""
    first = next(iter(cells.values()))
    methods = [m for m in first.methods if m != BASELINE]
    classes = sorted({int(y) for c in cells.values() for y in c.arrays["labels"]})
    draws = has_draws(cells)
    out = []
    for measure in MEASURES:
        for m in methods:
            table: dict[int, dict[int, float]] = {k: {} for k in classes}
            for s, cell in sorted(cells.items()):
                labels = cell.arrays["labels"]
                values = per_image(cell, m, measure)
                if measure != "rho":  # against random: the draws' per-image mean, or the one order
                    base = (
                        np.nanmean(cell.arrays[f"random_draws/{measure}"], axis=0)
                        if draws
                        else per_image(cell, BASELINE, measure)
                        if BASELINE in cell.methods
                        else np.zeros_like(values)
                    )
                    values = values - base
                for k in classes:
                    table[k][s] = seed_value(values[labels == k])
            out.append(ClassRow(m, measure, table))
    return out


@dataclass(frozen=True)
class SanityRow:
    method: str
    per_step: list[float]  # mean over seeds of the mean over images, one per step
    per_seed_last: dict[int, float]  # each seed's mean at the last step
    mode: str = "blocks"  # cascade, independent, or blocks (evidence from before the cascade)
    metric: str = "rho"  # rho, abs_rho, ssim

    @property
    def survives(self) -> bool:
        return math.isfinite(self.per_step[-1]) and self.per_step[-1] >= SURVIVES


def _sanity_row(cells, key: str, method: str, mode: str, metric: str) -> SanityRow:
    # (seeds, steps)
    steps = np.stack([[seed_value(row) for row in c.arrays[key]] for _, c in sorted(cells.items())])
    return SanityRow(
        method,
        [seed_value(col) for col in steps.T],
        {s: float(steps[i, -1]) for i, s in enumerate(sorted(cells))},
        mode,
        metric,
    )


def sanity(cells: dict[int, AttributionCellResult]) -> list[SanityRow]:
    """Every (form, metric, method) row the cells logged (old evidence: rho of form ``blocks``)."""
    first = next(iter(cells.values()))
    if sanity_form(cells) == "blocks":
        methods = [m for m in first.methods if f"sanity/{m}" in first.arrays]
        return [_sanity_row(cells, f"sanity/{m}", m, "blocks", "rho") for m in methods]
    out = []
    for mode in SANITY_MODES:
        for metric in SANITY_METRICS:
            for m in first.methods:
                key = f"sanity_{mode}/{metric}/{m}"
                if key in first.arrays:
                    out.append(_sanity_row(cells, key, m, mode, metric))
    return out


def sanity_verdicts(cells: dict[int, AttributionCellResult]) -> dict[str, SanityRow]:
    """Per method, the row its flag is read from: rho with every layer random (the cascade's last step)."""
    if not has_sanity(cells):
        return {}
    return {r.method: r for r in sanity(cells) if r.metric == "rho" and r.mode != "independent"}


@dataclass(frozen=True)
class StartRow:
    seed: int
    predicted: int  # the class most often predicted from the class token alone
    share: float  # the share of images it is predicted for
    prob: float  # the mean probability of the predicted class
    true_class_prob: float  # the mean true-class probability: the insertion curves' first point


def insertion_start(cells: dict[int, AttributionCellResult]) -> list[StartRow]:
    out = []
    for s, c in sorted(cells.items()):
        a = c.arrays
        counts = np.bincount(a["insertion_start_predicted"])
        first = a["insertion_prob/" + c.methods[0]][:, 0]
        out.append(
            StartRow(
                s,
                int(counts.argmax()),
                float(counts.max() / counts.sum()),
                float(a["insertion_start_prob"].mean()),
                float(first.mean()),
            )
        )
    return out


def rho_interval(cells: dict[int, AttributionCellResult], method: str, confidence: float):
    """(mean over seeds, Fisher-z interval) of a method's rho."""
    values = {s: seed_value(per_image(c, method, "rho")) for s, c in cells.items()}
    defined = [v for v in values.values() if math.isfinite(v)]
    mean = float(np.mean(defined)) if defined else math.nan
    return mean, stats.fisher_z_interval(defined, confidence)
