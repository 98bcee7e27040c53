"""Everything a report shows for one comparison or one arm, from what ``workbench.stats`` computed.

The renderer computes ``PairedComparison`` and the hierarchical bootstrap ``CI`` as it does
today and calls ``comparison_content`` once per comparison: the paragraph, the effect size,
the per-seed rows, the bootstrap display and the forest-plot row then come from the same
numbers and cannot drift apart. ``arm_content`` does the same for one arm's mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reports.content.forest import ForestRow
from workbench.estimates import (
    EffectSize,
    MeanInterval,
    mean_interval,
    paired_effect_size,
)
from reports.content.rounding import (
    BootstrapDisplay,
    PairedDisplay,
    bootstrap_display,
    fmt,
    paired_display,
)
from reports.content.wording import ResultsParagraph, results_paragraph


@dataclass(frozen=True)
class ComparisonContent:
    """One comparison a - b, ready to render."""

    a: str
    b: str
    split: str
    seeds: list
    per_seed: PairedDisplay  # rows in the order of ``seeds``
    paragraph: ResultsParagraph
    effect: EffectSize
    bootstrap: BootstrapDisplay | None
    forest_row: ForestRow


def comparison_content(
    paired: Any,
    bootstrap: Any,
    values_a: Mapping[Any, float],
    values_b: Mapping[Any, float],
    *,
    a_label: str,
    b_label: str,
    split: str = "test",
    stated_test: str | None = None,
    expected_n: int | None = None,
    scale: float = 100.0,
    unit: str = "points",
    metric: str = "accuracy",
) -> ComparisonContent:
    """The content of one seed-paired comparison.

    Args:
        paired: ``workbench.stats.PairedComparison`` of a - b.
        bootstrap: The hierarchical bootstrap ``CI`` of the same difference, or None.
        values_a, values_b: Seed -> value of each arm (the ones ``paired`` was computed from).
        a_label, b_label: Arm names.
        split, stated_test, expected_n, scale, unit, metric: As in ``results_paragraph``.
    """
    seeds = list(paired.seeds)
    per_seed = paired_display([values_a[s] for s in seeds], [values_b[s] for s in seeds], scale)
    paragraph = results_paragraph(
        paired,
        bootstrap,
        a_label=a_label,
        b_label=b_label,
        split=split,
        metric=metric,
        scale=scale,
        unit=unit,
        stated_test=stated_test,
        expected_n=expected_n,
    )
    effect = paired_effect_size(paired.differences, paired.confidence)
    boot = bootstrap_display(bootstrap, scale, unit) if bootstrap is not None else None
    row = ForestRow(
        a_label,
        paired.mean_difference,
        paired.ci_low,
        paired.ci_high,
        float("nan") if bootstrap is None else bootstrap.low,
        float("nan") if bootstrap is None else bootstrap.high,
        paired.wins,
        paired.n,
        paired.ties,
    )
    return ComparisonContent(a_label, b_label, split, seeds, per_seed, paragraph, effect, boot, row)


@dataclass(frozen=True)
class ArmContent:
    """One arm's mean over seeds with its t-interval, and the text to show."""

    interval: MeanInterval
    text: str


def arm_content(
    values: Mapping[Any, float], confidence: float = 0.95, scale: float = 100.0, decimals: int = 2
) -> ArmContent:
    """An arm's mean over seeds with its Student-t interval, e.g. "80.25 (95% t-interval 78.10 to 82.40; 3 seeds)"."""
    mi = mean_interval(values, confidence)
    seeds = f"{mi.n} seed{'s' if mi.n != 1 else ''}"
    if mi.note:
        text = f"{fmt(mi.mean * scale, decimals)} ({seeds}; {mi.note})"
    else:
        text = (
            f"{fmt(mi.mean * scale, decimals)} ({confidence:.0%} t-interval {fmt(mi.low * scale, decimals)} to "
            f"{fmt(mi.high * scale, decimals)}; {seeds})"
        )
    return ArmContent(mi, text)
