"""The results paragraph of one comparison, generated from its numbers.

Rules the wording keeps, so a paragraph never claims more than the numbers do:

- It states the mean difference with BOTH intervals (between-seed t-interval and
  hierarchical bootstrap) whenever both exist, and the wider one decides the sentence on
  whether the sign is settled (the bootstrap's seed level is narrow with few seeds).
- "ahead in k of n seeds", never "won" or "better" as a verdict.
- The word "significant" appears only when a test was stated in advance (the protocol's
  test) and then only with that test's p and level.
- It states the resolution of the seed level: the smallest attainable two-sided Wilcoxon
  signed-rank p (2 / 2^n) and the number of distinct seed multisets the bootstrap can draw
  (C(2n - 1, n)).

``comparison`` is duck-typed on ``workbench.stats.PairedComparison`` and ``bootstrap`` on
``workbench.stats.CI``, so the renderer passes what it already computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from scipy import stats as sps

from workbench.report_content.numbers import bootstrap_seed_multisets, min_wilcoxon_p
from workbench.report_content.rounding import bootstrap_display, fmt

STATED_TESTS = {"paired_t": ("paired t-test", "p_value"), "wilcoxon": ("Wilcoxon signed-rank test", "wilcoxon_p_value")}
FEW_SEEDS = 6  # below this the exact Wilcoxon test cannot reach p < 0.05 (2 / 2^5 = 0.0625)


@dataclass(frozen=True)
class ResultsParagraph:
    """The paragraph and what decided it (for tests and for the renderer's footnotes)."""

    text: str
    driving_interval: str  # "t-interval", "bootstrap" or "none"
    sign_settled: bool | None  # whether the wider interval excludes zero; None without any interval
    footnotes: list[str] = field(default_factory=list)


def _p(p: float) -> str:
    if not math.isfinite(p):
        return "n/a"
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def _interval_width(low: float, high: float) -> float:
    return high - low if math.isfinite(low) and math.isfinite(high) else math.nan


def results_paragraph(comparison: Any, bootstrap: Any = None, *, a_label: str | None = None, b_label: str | None = None,
                      split: str = "test", metric: str = "accuracy", scale: float = 100.0, unit: str = "points",
                      decimals: int = 2, stated_test: str | None = None, alpha: float = 0.05,
                      expected_n: int | None = None) -> ResultsParagraph:
    """Sentences stating one seed-paired comparison a - b.

    Args:
        comparison: A ``PairedComparison`` (a - b over seeds).
        bootstrap: The hierarchical bootstrap ``CI`` of the same difference, or None.
        a_label, b_label: Arm names as the reader knows them (default "a" and "b").
        split: Which split the values are from ("test", "validation").
        metric: The metric's name in words.
        scale, unit: Display scale (100 and "points" for accuracies in [0, 1]).
        decimals: Decimals of the mean and the t-interval.
        stated_test: The test the protocol named in advance ("paired_t" or "wilcoxon"), or
            None: then p-values are reported as descriptive and "significant" is never used.
        alpha: Level of the stated test.
        expected_n: Seeds the protocol has; fewer in the comparison are named.

    Returns:
        The paragraph, which interval drove it, and footnotes (bootstrap Monte-Carlo error).
    """
    if stated_test is not None and stated_test not in STATED_TESTS:
        raise ValueError(f"stated_test={stated_test!r}: must be one of {', '.join(STATED_TESTS)} or None")
    a, b = a_label or "a", b_label or "b"
    c, n = comparison, int(comparison.n)
    conf = f"{c.confidence:.0%}"
    mean = fmt(c.mean_difference * scale, decimals, signed=True)
    t_low, t_high = c.ci_low * scale, c.ci_high * scale
    t_ok = math.isfinite(t_low) and math.isfinite(t_high)
    parts = [f"{conf} t-interval {fmt(t_low, decimals, True)} to {fmt(t_high, decimals, True)}" if t_ok
             else "no t-interval"]
    footnotes: list[str] = []
    b_low = b_high = math.nan
    if bootstrap is not None and math.isfinite(bootstrap.low) and math.isfinite(bootstrap.high):
        shown = bootstrap_display(bootstrap, scale, unit)
        parts.append(f"bootstrap {shown.low} to {shown.high}")
        footnotes.append(shown.footnote)
        b_low, b_high = bootstrap.low * scale, bootstrap.high * scale
    sentences = [f"On {split}, {a} minus {b} is {mean} {unit} of {metric} ({'; '.join(parts)})."]

    ties = f", {c.ties} tied" if c.ties else ""
    seeds = f"seed{'s' if n != 1 else ''}"
    if c.wins and c.losses:  # split seeds: name both sides, never only the larger
        sentences.append(f"{a} is ahead in {c.wins} of {n} {seeds} and {b} in {c.losses}{ties}.")
    else:
        leader, k = (a, c.wins) if c.wins >= c.losses else (b, c.losses)
        sentences.append(f"{leader} is ahead in {k} of {n} {seeds}{ties}.")
    if expected_n is not None and n < expected_n:
        sentences.append(f"Only {n} of the protocol's {expected_n} seeds have finished runs of both arms.")
    if c.note:
        sentences.append(c.note[0].upper() + c.note[1:] + ".")
    if t_ok and t_high - t_low == 0:
        sentences.append("A zero-width t-interval here is the absence of spread between seeds, not certainty.")

    # The wider interval decides whether the sign is settled.
    t_w, b_w = _interval_width(t_low, t_high), _interval_width(b_low, b_high)
    if math.isnan(t_w) and math.isnan(b_w):
        driving, settled = "none", None
        sentences.append("Without an interval, these seeds cannot say which arm is ahead.")
    else:
        use_t = math.isnan(b_w) or (not math.isnan(t_w) and t_w >= b_w)
        driving = "t-interval" if use_t else "bootstrap"
        low, high = (t_low, t_high) if use_t else (b_low, b_high)
        single = math.isnan(t_w) or math.isnan(b_w)
        which = "The only interval" if single else "The wider of the two intervals"
        settled = low > 0 or high < 0
        if settled:
            side, where = (a, "above") if low > 0 else (b, "below")
            sentences.append(f"{which if single else 'Even ' + which[0].lower() + which[1:]}, the {driving}, lies "
                             f"entirely {where} zero: {side} is ahead over the whole interval.")
        else:
            sentences.append(f"{which}, the {driving}, includes zero, so these {n} seeds "
                             "do not settle which arm is ahead.")

    # Resolution of the seed level, before any p-value is read.
    if n >= 2:
        t_q = float(sps.t.ppf(0.5 + c.confidence / 2, n - 1))
        wide = f"the t-interval is wide (t quantile {t_q:.2f} on {n - 1} degree{'s' if n != 2 else ''} of freedom) and " \
            if n < FEW_SEEDS else ""
        sentences.append(f"With {n} seeds {wide}the smallest attainable two-sided Wilcoxon signed-rank p is "
                         f"{min_wilcoxon_p(n):.3g}.")
    if not math.isnan(b_w):
        sets = bootstrap_seed_multisets(n)
        if n < FEW_SEEDS:
            sentences.append(f"The bootstrap resamples seeds and then examples; from {n} seed{'s' if n != 1 else ''} it "
                             f"can draw only {sets} distinct seed set{'s' if sets != 1 else ''}, so its seed level is "
                             "coarse.")
        else:
            sentences.append(f"The bootstrap resamples seeds and then examples; its seed level draws from {sets:,} "
                             "distinct seed sets.")
    p_text = f"paired t-test p = {_p(c.p_value)}, Wilcoxon signed-rank p = {_p(c.wilcoxon_p_value)}"
    if stated_test is None:
        sentences.append(f"No test was stated in advance, so the p-values are descriptive ({p_text}).")
    else:
        name, attr = STATED_TESTS[stated_test]
        p = float(getattr(c, attr))
        if math.isfinite(p) and p < alpha:
            verdict = f"the difference is significant at the {alpha:g} level"
        elif math.isfinite(p):
            verdict = f"the difference is not significant at the {alpha:g} level"
        else:
            verdict = "no verdict is possible (the test is undefined here)"
        sentences.append(f"By the stated test ({name}, p = {_p(p)}) {verdict} ({p_text}).")
    return ResultsParagraph(" ".join(sentences), driving, settled, footnotes)
