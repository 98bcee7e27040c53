"""Everything a report shows for one interaction (a - b) - (c - d), from what ``workbench.stats`` computed.

An interaction is a difference of two paired differences, e.g. what a training recipe adds to a
ViT minus what it adds to a CNN. The renderer computes it as a ``PairedComparison`` of the
per-seed differences a - b against c - d (so its t-interval, p-values and wins are the
interaction's) and the four-arm hierarchical bootstrap, and calls ``interaction_content`` once:
the sentence, the per-seed values, the effect size, the bootstrap display and the forest-plot
row come from the same numbers. The sentence follows ``results_paragraph``'s rules (both
intervals, the wider one deciding whether the sign is settled, "larger in k of n seeds",
p-values descriptive) and reuses its parts, as ``intervention_wording`` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reports.content.forest import ForestRow
from workbench.estimates import EffectSize, paired_effect_size
from reports.content.rounding import (
    BootstrapDisplay,
    bootstrap_display,
    exact_decimals,
    fmt,
    to_decimal,
)
from reports.content.wording import ResultsParagraph, p_value_text, results_paragraph


@dataclass(frozen=True)
class InteractionContent:
    """One interaction (a - b) - (c - d), ready to render."""

    arms: tuple[str, str, str, str]
    label: str  # "(a − b) − (c − d)"
    seeds: list
    # signed, from the displayed per-seed values of the four arms, in the order of ``seeds``
    per_seed: list[str]
    text: str  # the stated result
    paragraph: ResultsParagraph  # what decided it (intervals, verdict, caveats, exceptions)
    effect: EffectSize
    bootstrap: BootstrapDisplay | None
    forest_row: ForestRow


def interaction_label(arms: Sequence[str]) -> str:
    a, b, c, d = arms
    return f"({a} − {b}) − ({c} − {d})"


def per_seed_display(
    values: Sequence[Sequence[float]], scale: float = 100.0, decimals: int | None = None
) -> list[str]:
    """Per seed, (a - b) - (c - d) of the four arms' values as displayed (``decimals``; None: the fewest in
    [2, 3] showing every value exactly), so a reader recomputes each from the accuracy table."""
    scaled = [[float(x) * scale for x in arm] for arm in values]
    d = (
        exact_decimals([x for arm in scaled for x in arm], 2, 3)
        if decimals is None
        else int(decimals)
    )
    a, b, c, e = ([to_decimal(x, d) for x in arm] for arm in scaled)
    return [fmt((w - x) - (y - z), d, signed=True) for w, x, y, z in zip(a, b, c, e)]


def interaction_content(
    paired: Any,
    bootstrap: Any,
    values: Mapping[str, Mapping[Any, float]],
    arms: Sequence[str],
    *,
    split: str = "validation",
    expected_n: int | None = None,
    decimals: int | None = None,
    scale: float = 100.0,
    unit: str = "points",
    metric: str = "accuracy",
) -> InteractionContent:
    """The content of one interaction.

    Args:
        paired: ``workbench.stats.PairedComparison`` of the per-seed a - b against c - d.
        bootstrap: ``workbench.stats.hierarchical_interaction_bootstrap``'s CI, or None.
        values: Arm -> seed -> value of each of the four arms (the ones ``paired`` was computed from).
        arms: (a, b, c, d).
        split, expected_n, scale, unit, metric: As in ``results_paragraph``.
        decimals: Decimals of the displayed per-seed values (those of the accuracy table).
    """
    a, b, c, d = arms
    left, right = f"{a} − {b}", f"{c} − {d}"
    label = interaction_label(arms)
    seeds = list(paired.seeds)
    per_seed = per_seed_display([[values[arm][s] for s in seeds] for arm in arms], scale, decimals)
    careful = results_paragraph(
        paired,
        bootstrap,
        a_label=left,
        b_label=right,
        split=split,
        metric=metric,
        scale=scale,
        unit=unit,
    )
    effect = paired_effect_size(paired.differences, paired.confidence)
    boot = bootstrap_display(bootstrap, scale, unit) if bootstrap is not None else None
    row = ForestRow(
        label,
        paired.mean_difference,
        paired.ci_low,
        paired.ci_high,
        float("nan") if bootstrap is None else bootstrap.low,
        float("nan") if bootstrap is None else bootstrap.high,
        paired.wins,
        paired.n,
        paired.ties,
    )
    text = _sentence(paired, careful, label, left, right, split, unit, metric, scale)
    if expected_n is not None and paired.n < expected_n:
        text += f" Only {paired.n} of the protocol's {expected_n} seeds have finished runs of all four arms."

    return InteractionContent(tuple(arms), label, seeds, per_seed, text, careful, effect, boot, row)


def _sentence(
    c: Any,
    careful: ResultsParagraph,
    label: str,
    left: str,
    right: str,
    split: str,
    unit: str,
    metric: str,
    scale: float,
) -> str:
    n = int(c.n)
    mean = fmt(c.mean_difference * scale, 2, signed=True)
    ties = f", {c.ties} tied" if c.ties else ""
    s = "s" if n != 1 else ""
    if c.wins and c.losses:
        seeds = f"{left} the larger difference in {c.wins} of {n} seed{s} and {right} in {c.losses}{ties}"
    else:
        leader, k = (left, c.wins) if c.wins >= c.losses else (right, c.losses)
        seeds = f"{leader} the larger difference in {k} of {n} seed{s}{ties}"
    p = (
        f" (descriptive p: paired t-test {p_value_text(c.p_value)}, Wilcoxon signed-rank "
        f"{p_value_text(c.wilcoxon_p_value)})"
        if math.isfinite(c.p_value) or math.isfinite(c.wilcoxon_p_value)
        else ""
    )
    these = f"these {n} seeds do not" if n != 1 else "this one seed does not"
    lead = f"On {split}, {label} is {mean} {unit} of {metric} ({careful.intervals}), with {seeds}; "
    if careful.sign_settled:
        lead += f"{careful.verdict}: {careful.settled_for} is the larger difference over the whole interval{p}."
    elif careful.sign_settled is False:
        lead += f"{careful.verdict}, so {these} settle whether {left} is larger or smaller than {right}{p}."
    else:
        lead += f"{careful.verdict}, so these seeds cannot say which difference is larger."
    # seeds missing, a note, a zero-width interval: after the result
    return " ".join([lead, *careful.exceptions])
