"""Has a cell stopped improving? Its best epoch against its last, and the slope of its late curve.

Read from each cell's logged per-epoch validation accuracy (the MLflow metric history). Two
figures per cell, both stated in the report:

- the best epoch (the first epoch reaching the highest validation accuracy) against the last;
- the least-squares slope of validation accuracy, in points per epoch, over the last quarter of
  the epochs it ran (at least 2 epochs, so a 4-epoch cell uses its last 2).

A cell counts as still improving when its best epoch is its last and the late slope is above
zero: its curve had not flattened, so a longer schedule could move its accuracy. A best epoch
before the last, or a late slope at or below zero, is read as flattened. This is a description of
the logged curve, not a test: a slope from 2 to 5 noisy points has no interval here.

The slope is computed in exact rational arithmetic on the logged floats and rounded once at the
end, so a curve gives the same slope bit for bit on every machine. Accuracies are counts over a
fixed validation set, so exact ties at the report's second decimal are common (a 5-epoch fit on
10,000 images lands on multiples of 0.001 points); numpy's polyfit goes through LAPACK, whose
last bits vary with the CPU, and one published slope printed +0.83 on one machine and +0.82 on
another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from reports.render import Block, Para, Table

MIN_LATE_EPOCHS = 2


@dataclass(frozen=True)
class Convergence:
    epochs: int  # the epochs the curve holds
    best_epoch: int
    best: float  # validation accuracy, %
    last: float  # validation accuracy at the last epoch, %
    late_epochs: int  # how many of the last epochs the slope is fitted on
    late_slope: float  # points per epoch

    @property
    def still_improving(self) -> bool:
        return self.best_epoch == self.epochs and self.late_slope > 0


def least_squares_slope(xs: list[int], ys: list[float]) -> float:
    """The least-squares slope of ys on xs, exact in rationals and rounded once (see above)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a slope needs at least 2 paired points, got {len(xs)} and {len(ys)}")
    x_mean = Fraction(sum(xs), len(xs))
    exact = [Fraction(y) for y in ys]
    y_mean = sum(exact) / len(exact)
    spread = sum((x - x_mean) ** 2 for x in xs)
    if spread == 0:
        raise ValueError(f"a slope needs at least 2 distinct x values, got {xs}")
    return float(sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, exact)) / spread)


def convergence(curve: dict[int, float]) -> Convergence | None:
    """A validation-accuracy curve (epoch -> fraction correct) read as above; None if too short."""
    epochs = sorted(curve)
    if len(epochs) < MIN_LATE_EPOCHS:
        return None
    values = np.array([100.0 * curve[e] for e in epochs])
    late = max(MIN_LATE_EPOCHS, math.ceil(len(epochs) / 4))
    slope = least_squares_slope(epochs[-late:], [float(v) for v in values[-late:]])
    best = int(np.argmax(values))  # the first of equal maxima
    return Convergence(
        len(epochs), epochs[best], float(values[best]), float(values[-1]), late, slope
    )


def convergence_blocks(
    curves: dict[tuple[str, int], dict[int, float]], units: list[str], *, unit: str = "arm"
) -> list[Block]:
    """The per-cell table and one sentence over all cells (empty when no curve is long enough).

    Args:
        curves: (arm or regime, seed) -> validation accuracy per epoch (fraction correct).
        units: Arms or regimes in report order.
        unit: "arm" or "regime", the table's first column.
    """
    found = {k: c for k, c in ((k, convergence(v)) for k, v in curves.items()) if c is not None}
    if not found:
        return []
    rows = []
    for (u, seed), c in sorted(found.items(), key=lambda kv: (units.index(kv[0][0]), kv[0][1])):
        rows.append(
            [
                u,
                str(seed),
                f"{c.best_epoch} of {c.epochs}",
                f"{c.best:.2f}",
                f"{c.last:.2f}",
                f"{c.late_slope:+.2f} ({c.late_epochs})",
                "still improving" if c.still_improving else "flattened",
            ]
        )
    improving = sum(c.still_improving for c in found.values())
    at_last = sum(c.best_epoch == c.epochs for c in found.values())
    slopes = [c.late_slope for c in found.values()]
    summary = (
        f"Convergence: {at_last} of {len(found)} cells had their best validation accuracy at their "
        f"last epoch; the late slope (least squares over the last quarter of the epochs, at least "
        f"{MIN_LATE_EPOCHS}) runs from {min(slopes):+.2f} to {max(slopes):+.2f} points per epoch; "
        f"{improving} of {len(found)} cells were still improving (best epoch the last and late "
        "slope above zero), so a longer schedule could move their accuracy. A description of the "
        "logged curves, not a test: the slopes have no interval."
    )
    return [
        Para(summary),
        Table(
            [
                unit,
                "seed",
                "best epoch",
                "best val %",
                "last val %",
                "late slope (epochs)",
                "curve",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "l"],
            [
                "Late slope: points of validation accuracy per epoch, fitted over the last epochs "
                "in brackets. 'still improving': best epoch is the last and the late slope is "
                "above zero; otherwise 'flattened'."
            ],
        ),
    ]
