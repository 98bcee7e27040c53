"""The numbers of an intervention report: per intervention the accuracy change over seeds, paired by seed
and by example, the block x head matrix, and how consistently the seeds rank the heads.

Each intervention is compared with the intact model of the same cell, on the same examples:
``workbench.stats.paired_seed_comparison`` over seeds (mean change, Student-t interval, in
how many seeds accuracy fell) and ``paired_hierarchical_bootstrap`` over seeds and examples
(from the per-example predictions every cell logged). Nothing here renders.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from workbench.interventions.spec import HeadAblation, Intervention, parse
from workbench.stats import (
    CI,
    PairedComparison,
    paired_hierarchical_bootstrap,
    paired_seed_comparison,
)


@dataclass(frozen=True)
class CellOutcomes:
    """One cell's per-example outcomes (what ``interventions/per_example.npz`` holds)."""

    names: list[str]
    labels: np.ndarray  # (N,)
    intact_predicted: np.ndarray  # (N,)
    predicted: np.ndarray  # (K, N)

    def accuracy(self, k: int | None = None) -> float:
        pred = self.intact_predicted if k is None else self.predicted[k]
        return float((pred == self.labels).mean())


@dataclass(frozen=True)
class InterventionRow:
    """One intervention over the seeds of one arm: ``paired`` is intervened - intact accuracy (fractions)."""

    name: str
    item: Intervention | None  # None for a named set
    intact: dict[int, float]
    intervened: dict[int, float]
    paired: PairedComparison
    bootstrap: CI

    @property
    def kind(self) -> str:
        return (
            "head"
            if isinstance(self.item, HeadAblation)
            else "set"
            if self.item is None
            else "other"
        )

    @property
    def lower_in(self) -> int:
        """Seeds in which the intervention lowered accuracy."""
        return self.paired.losses

    def excludes_zero(self, which: str = "t") -> bool:
        """Whether the interval lies on one side of zero; a zero-width interval (no spread) never counts."""
        low, high = (
            (self.paired.ci_low, self.paired.ci_high)
            if which == "t"
            else (self.bootstrap.low, self.bootstrap.high)
        )
        return math.isfinite(low) and math.isfinite(high) and high > low and (low > 0 or high < 0)


def _item(name: str) -> Intervention | None:
    return None if name.startswith("set.") else parse(name)  # a set is known by its name only


def summarize(
    cells: dict[int, CellOutcomes], n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> list[InterventionRow]:
    """Every intervention of one arm, in grid order, from its cells (seed -> outcomes).

    Raises:
        ValueError: The cells do not hold the same interventions on the same examples.
    """
    seeds = sorted(cells)
    names = cells[seeds[0]].names
    for s in seeds:
        if cells[s].names != names:
            raise ValueError(
                f"seed {s}: its cell holds other interventions than seed {seeds[0]}'s; "
                "report one grid at a time"
            )
    intact = {s: cells[s].accuracy() for s in seeds}
    rows = []
    for k, name in enumerate(names):
        intervened = {s: cells[s].accuracy(k) for s in seeds}
        paired = paired_seed_comparison(intervened, intact, confidence, names=(name, "intact"))
        boot = paired_hierarchical_bootstrap(
            {s: (cells[s].labels, cells[s].predicted[k]) for s in seeds},
            {s: (cells[s].labels, cells[s].intact_predicted) for s in seeds},
            "accuracy",
            n_resamples=n_resamples,
            confidence=confidence,
            seed=seed,
        )
        rows.append(InterventionRow(name, _item(name), intact, intervened, paired, boot))
    return rows


def ranked(rows: list[InterventionRow]) -> list[InterventionRow]:
    """Largest drop first (most negative mean change), ties by name."""
    return sorted(rows, key=lambda r: (r.paired.mean_difference, r.name))


def head_matrix(
    rows: list[InterventionRow], mode: str, depth: int, heads: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(depth, heads)`` mean accuracy change of each head ablated in ``mode`` (nan where not in the grid),
    and where its t-interval excludes zero."""
    mean, marked = np.full((depth, heads), np.nan), np.zeros((depth, heads), dtype=bool)
    for r in rows:
        if (
            isinstance(r.item, HeadAblation)
            and r.item.mode == mode
            and r.item.block < depth
            and r.item.head < heads
        ):
            mean[r.item.block, r.item.head] = r.paired.mean_difference
            marked[r.item.block, r.item.head] = r.excludes_zero("t")
    return mean, marked


@dataclass(frozen=True)
class SeedAgreement:
    """Spearman rank correlation of head importance (accuracy change per head) between two seeds."""

    seed_a: int
    seed_b: int
    rho: float  # nan when a seed's changes have no spread (all tied)


def seed_consistency(rows: list[InterventionRow], mode: str) -> list[SeedAgreement]:
    """Every pair of seeds: how alike they rank the heads ablated in ``mode``."""
    heads = [r for r in rows if isinstance(r.item, HeadAblation) and r.item.mode == mode]
    if len(heads) < 3:
        return []
    seeds = sorted(heads[0].intact)
    change = {s: np.array([r.intervened[s] - r.intact[s] for r in heads]) for s in seeds}
    out = []
    for i, a in enumerate(seeds):
        for b in seeds[i + 1 :]:
            with warnings.catch_warnings():
                # a constant input: scipy warns and returns nan, which we keep
                warnings.simplefilter("ignore")
                rho = float(sps.spearmanr(change[a], change[b]).statistic)
            out.append(SeedAgreement(a, b, rho))
    return out
