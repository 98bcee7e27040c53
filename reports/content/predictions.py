"""Degenerate classifiers: which classes each run never predicts, said out loud.

On RetinaMNIST most models never predict grade 1 and none predicts grade 4; a per-class
recall of "0.000 [0.000, 0.000]" then reads as certainty when it is a model that never
says that class. ``degenerate_predictions`` counts predicted classes per run and writes a
warning naming every class a run never predicts; ``interval_text`` refuses to render a
zero-width interval unless a warning is attached (``ZeroWidthIntervalError``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reports.content.rounding import fmt


class ZeroWidthIntervalError(ValueError):
    """A zero-width interval was about to be shown without the warning that explains it."""


@dataclass(frozen=True)
class DegenerateReport:
    """Predicted-class counts per run and the classes never predicted.

    Attributes:
        class_names: Display name of each class index.
        counts: Run -> predicted-class counts, length K.
        label_counts: Run -> true-class counts (empty when only predictions were given).
        never_predicted: Run -> class indices it never predicts (every run listed, [] if none).
        never_by_any: Classes no run predicts.
        warnings: One sentence per class that some run never predicts.
    """

    class_names: list[str]
    counts: dict[str, list[int]]
    label_counts: dict[str, list[int]]
    never_predicted: dict[str, list[int]]
    never_by_any: list[int]
    warnings: list[str]

    @property
    def degenerate(self) -> bool:
        return any(self.never_predicted.values())

    def warning_for(self, cls: int, runs: Sequence[str] | None = None) -> str | None:
        """The warning to attach to an interval of class ``cls`` over ``runs`` (default: all), or None."""
        runs = list(self.counts) if runs is None else list(runs)
        missing = [r for r in runs if cls in self.never_predicted.get(r, [])]
        if not missing:
            return None
        who = (
            "any run"
            if len(missing) == len(runs)
            else f"{len(missing)} of {len(runs)} runs ({', '.join(missing)})"
        )
        return f"{self.class_names[cls]} is never predicted by {who}: its recall is 0 by construction, not measured as 0"


def _split(value: Any) -> tuple[np.ndarray | None, np.ndarray]:
    if isinstance(value, tuple) and len(value) == 2:
        return np.asarray(value[0]), np.asarray(value[1])
    return None, np.asarray(value)


def _counts(a: np.ndarray, k: int, run: str, what: str) -> list[int]:
    if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iu":
        raise ValueError(
            f"run {run}: {what} must be a non-empty 1-D array of class indices, got shape {a.shape} "
            f"dtype {a.dtype}"
        )
    if a.min() < 0 or a.max() >= k:
        raise ValueError(
            f"run {run}: {what} contain class {int(a[(a < 0) | (a >= k)][0])}, outside 0..{k - 1}"
        )
    return np.bincount(a, minlength=k).astype(int).tolist()


def degenerate_predictions(
    runs: Mapping[str, Any], num_classes: int, class_names: Sequence[str] | None = None
) -> DegenerateReport:
    """Count predicted classes per run from saved predictions and name the ones never predicted.

    Args:
        runs: Run key (e.g. ``vit/seed0``) -> predicted class indices, or (labels, predicted);
            with labels the warnings say how many examples of a never-predicted class exist.
        num_classes: K.
        class_names: Names of the K classes (default ``class 0`` ...).
    """
    if not runs:
        raise ValueError("degenerate_predictions: no runs")
    names = (
        list(class_names) if class_names is not None else [f"class {i}" for i in range(num_classes)]
    )
    if len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for {num_classes} classes")
    counts, label_counts, never = {}, {}, {}
    for run, value in runs.items():
        labels, predicted = _split(value)
        counts[run] = _counts(predicted, num_classes, run, "predictions")
        if labels is not None:
            label_counts[run] = _counts(labels, num_classes, run, "labels")
        never[run] = [c for c in range(num_classes) if counts[run][c] == 0]
    never_by_any = [c for c in range(num_classes) if all(c in v for v in never.values())]
    warnings = []
    for c in range(num_classes):
        missing = [r for r in runs if c in never[r]]
        if not missing:
            continue
        support = sorted({label_counts[r][c] for r in missing if r in label_counts})
        n_true = ""
        if (
            len(support) == 1
        ):  # one evaluation set (the usual case): say how many examples go unrecognised
            n_true = f" ({support[0]} example{'s' if support[0] != 1 else ''} of it in the evaluated data)"
        if len(runs) == 1:
            who = f"run {missing[0]} never predicts it"
        elif len(missing) == len(runs):
            who = f"none of the {len(runs)} runs predicts it"
        else:
            who = f"{len(missing)} of {len(runs)} runs never predict it ({', '.join(missing)})"
        warnings.append(f"{names[c]}: {who}{n_true}; its recall there is 0 by construction")
    return DegenerateReport(names, counts, label_counts, never, never_by_any, warnings)


def interval_text(
    estimate: float,
    low: float,
    high: float,
    decimals: int = 3,
    warning: str | None = None,
    what: str = "interval",
) -> str:
    """``estimate [low, high]``, refusing a zero-width interval that has no warning.

    A zero-width interval (all resamples equal) is not certainty: the model may never
    predict the class, or every seed may agree exactly. The caller must say which.

    Raises:
        ZeroWidthIntervalError: ``low == high`` and ``warning`` is empty.
    """
    text = f"{fmt(estimate, decimals)} [{fmt(low, decimals)}, {fmt(high, decimals)}]"
    if math.isfinite(low) and math.isfinite(high) and high - low == 0:
        if not warning:
            raise ZeroWidthIntervalError(
                f"{what}: zero-width interval {text} needs a warning that says why "
                "(e.g. a class the model never predicts)"
            )
        return f"{text} (zero width: {warning})"
    return f"{text} ({warning})" if warning else text
