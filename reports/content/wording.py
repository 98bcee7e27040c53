"""The stated result of one comparison, and the caveats its section states once, generated from the numbers.

Rules the wording keeps, so a sentence never claims more than the numbers do:

- It states the mean difference with BOTH intervals (between-seed t-interval and
  hierarchical bootstrap) whenever both exist, and the wider one decides the sentence on
  whether the sign is settled (the bootstrap's seed level is narrow with few seeds).
- "ahead in k of n seeds", never "won" or "better" as a verdict.
- The word "significant" appears only when a test was stated in advance (the protocol's
  test) and then only with that test's p and level.
- The resolution of the seed level (the t quantile with few seeds, the smallest attainable
  two-sided Wilcoxon signed-rank p, 2 / 2^n, and the number of distinct seed multisets the
  bootstrap can draw, C(2n - 1, n)) and the status of the p-values are the same for every
  comparison with the same number of seeds: ``ResultsParagraph.caveats`` holds them and a
  report states them once per section (``section_caveats``), not once per comparison.

``comparison`` is duck-typed on ``workbench.stats.PairedComparison`` and ``bootstrap`` on
``workbench.stats.CI``, so the renderer passes what it already computed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from scipy import stats as sps

from workbench.estimates import bootstrap_seed_multisets, min_wilcoxon_p
from reports.content.rounding import bootstrap_display, fmt

STATED_TESTS = {
    "paired_t": ("paired t-test", "p_value"),
    "wilcoxon": ("Wilcoxon signed-rank test", "wilcoxon_p_value"),
}
FEW_SEEDS = 6  # below this the exact Wilcoxon test cannot reach p < 0.05 (2 / 2^5 = 0.0625)
RULE = "Each result states both intervals where both exist; the wider of the two decides whether it calls the sign settled."


@dataclass(frozen=True)
class ResultsParagraph:
    """One comparison's stated result and what decided it (for tests, the renderer's footnotes and tables).

    ``text`` is one sentence (numbers, who is ahead in how many seeds, what the wider interval
    says), followed by a sentence for each exception: seeds missing, a note on the
    differences, a zero-width interval, the verdict of a test stated in advance.
    """

    text: str
    driving_interval: str  # "t-interval", "bootstrap" or "none"
    sign_settled: bool | None  # whether the wider interval excludes zero; None without any interval
    footnotes: list[str] = field(default_factory=list)
    caveats: tuple[
        str, ...
    ] = ()  # (seed level, bootstrap, tests) sentences: stated once per section
    intervals: str = ""  # "95% t-interval +1.00 to +3.00; bootstrap +0.5 to +3.5"
    ahead: str = ""  # "A ahead in 3 of 3 seeds"
    # "even the wider of the two intervals, the bootstrap, lies entirely above zero"
    verdict: str = ""
    # the arm ahead over the whole deciding interval ("" unless the sign is settled)
    settled_for: str = ""
    exceptions: tuple[
        str, ...
    ] = ()  # the sentences after the first (seeds missing, a note, zero width, a stated test)


def p_value_text(p: float) -> str:
    if not math.isfinite(p):
        return "n/a"
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def _interval_width(low: float, high: float) -> float:
    return high - low if math.isfinite(low) and math.isfinite(high) else math.nan


def _ahead(a: str, b: str, c: Any) -> str:
    n, ties = int(c.n), (f", {c.ties} tied" if c.ties else "")
    seeds = f"seed{'s' if n != 1 else ''}"
    if c.wins and c.losses:  # split seeds: name both sides, never only the larger
        return f"{a} ahead in {c.wins} of {n} {seeds} and {b} in {c.losses}{ties}"
    leader, k = (a, c.wins) if c.wins >= c.losses else (b, c.losses)
    return f"{leader} ahead in {k} of {n} {seeds}{ties}"


def _verdict(
    a: str, b: str, n: int, t: tuple[float, float], boot: tuple[float, float]
) -> tuple[str, bool | None, str, str, str]:
    """(driving interval, settled, what it says, what follows, the arm ahead if settled): the wider interval decides."""
    t_w, b_w = _interval_width(*t), _interval_width(*boot)
    if math.isnan(t_w) and math.isnan(b_w):
        return "none", None, "without an interval", "these seeds cannot say which arm is ahead", ""
    use_t = math.isnan(b_w) or (not math.isnan(t_w) and t_w >= b_w)
    driving = "t-interval" if use_t else "bootstrap"
    low, high = t if use_t else boot
    single = math.isnan(t_w) or math.isnan(b_w)
    which = "the only interval" if single else "the wider of the two intervals"
    if low > 0 or high < 0:
        side, where = (a, "above") if low > 0 else (b, "below")
        return (
            driving,
            True,
            f"{'' if single else 'even '}{which}, the {driving}, lies entirely {where} zero",
            f"{side} is ahead over the whole interval",
            side,
        )
    return (
        driving,
        False,
        f"{which}, the {driving}, includes zero",
        f"so these {n} seeds do not settle which arm is ahead",
        "",
    )


def seed_level_caveats(
    n: int, confidence: float = 0.95, bootstrap: bool = True, stated_test: str | None = None
) -> tuple[str, str, str]:
    """What every comparison over ``n`` seeds shares, as (seed level, bootstrap, tests) sentences ("" where none).

    The t quantile and the smallest attainable Wilcoxon p; the bootstrap's distinct seed
    sets; whether a test was stated in advance (then only it may say "significant").
    """
    seed_level = boot = ""
    if n >= 2:
        t_q = float(sps.t.ppf(0.5 + confidence / 2, n - 1))
        wide = (
            f"the t-interval is wide (t quantile {t_q:.2f} on {n - 1} degree{'s' if n != 2 else ''} of freedom) and "
            if n < FEW_SEEDS
            else ""
        )
        seed_level = (
            f"With {n} seeds {wide}the smallest attainable two-sided Wilcoxon signed-rank p is "
            f"{min_wilcoxon_p(n):.3g}."
        )
    if bootstrap:
        sets = bootstrap_seed_multisets(n)
        if n < FEW_SEEDS:
            boot = (
                f"The bootstrap resamples seeds and then examples; from {n} seed{'s' if n != 1 else ''} it can draw "
                f"only {sets} distinct seed set{'s' if sets != 1 else ''}, so its seed level is coarse."
            )
        else:
            boot = (
                f"The bootstrap resamples seeds and then examples; its seed level draws from {sets:,} distinct seed "
                "sets."
            )
    tests = (
        "No test was stated in advance, so no difference is called significant; p-values, where shown, are "
        "descriptive."
        if stated_test is None
        else f"The test stated in advance is the {STATED_TESTS[stated_test][0]}; other p-values are descriptive."
    )
    return seed_level, boot, tests


def section_caveats(paragraphs: Iterable[ResultsParagraph]) -> str:
    """The caveats of a section's comparisons: each distinct sentence once (seed levels, bootstraps, tests), then the rule."""
    paragraphs = [p for p in paragraphs if p.caveats]
    sentences = [
        s for slot in range(3) for s in dict.fromkeys(p.caveats[slot] for p in paragraphs) if s
    ]
    return " ".join(sentences + [RULE]) if sentences else ""


def results_paragraph(
    comparison: Any,
    bootstrap: Any = None,
    *,
    a_label: str | None = None,
    b_label: str | None = None,
    split: str = "test",
    metric: str = "accuracy",
    scale: float = 100.0,
    unit: str = "points",
    decimals: int = 2,
    stated_test: str | None = None,
    alpha: float = 0.05,
    expected_n: int | None = None,
) -> ResultsParagraph:
    """The stated result of one seed-paired comparison a - b, and the caveats its section states once.

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
        The sentence(s), which interval drove them, footnotes (bootstrap Monte-Carlo error) and the caveats.
    """
    if stated_test is not None and stated_test not in STATED_TESTS:
        raise ValueError(
            f"stated_test={stated_test!r}: must be one of {', '.join(STATED_TESTS)} or None"
        )
    a, b = a_label or "a", b_label or "b"
    c, n = comparison, int(comparison.n)
    mean = fmt(c.mean_difference * scale, decimals, signed=True)
    t_low, t_high = c.ci_low * scale, c.ci_high * scale
    t_ok = math.isfinite(t_low) and math.isfinite(t_high)
    parts = [
        f"{c.confidence:.0%} t-interval {fmt(t_low, decimals, True)} to {fmt(t_high, decimals, True)}"
        if t_ok
        else "no t-interval"
    ]
    footnotes: list[str] = []
    b_low = b_high = math.nan
    if bootstrap is not None and math.isfinite(bootstrap.low) and math.isfinite(bootstrap.high):
        shown = bootstrap_display(bootstrap, scale, unit)
        parts.append(f"bootstrap {shown.low} to {shown.high}")
        footnotes.append(shown.footnote)
        b_low, b_high = bootstrap.low * scale, bootstrap.high * scale
    intervals, ahead = "; ".join(parts), _ahead(a, b, c)
    driving, settled, verdict, follows, side = _verdict(a, b, n, (t_low, t_high), (b_low, b_high))
    joined = (
        f"{verdict}: {follows}"
        if settled
        else f"{verdict}, {follows}"
        if settled is False
        else f"{verdict} {follows}"
    )
    first = f"On {split}, {a} minus {b} is {mean} {unit} of {metric} ({intervals}), with {ahead}; {joined}."
    sentences: list[str] = []
    if expected_n is not None and n < expected_n:
        sentences.append(
            f"Only {n} of the protocol's {expected_n} seeds have finished runs of both arms."
        )
    if c.note:
        sentences.append(c.note[0].upper() + c.note[1:] + ".")
    if t_ok and t_high - t_low == 0:
        sentences.append(
            "A zero-width t-interval here is the absence of spread between seeds, not certainty."
        )
    if stated_test is not None:
        name, attr = STATED_TESTS[stated_test]
        p = float(getattr(c, attr))
        if math.isfinite(p) and p < alpha:
            verdict_test = f"the difference is significant at the {alpha:g} level"
        elif math.isfinite(p):
            verdict_test = f"the difference is not significant at the {alpha:g} level"
        else:
            verdict_test = "no verdict is possible (the test is undefined here)"
        sentences.append(
            f"By the stated test ({name}, p = {p_value_text(p)}) {verdict_test} (paired t-test "
            f"p = {p_value_text(c.p_value)}, Wilcoxon signed-rank p = {p_value_text(c.wilcoxon_p_value)})."
        )
    caveats = seed_level_caveats(n, c.confidence, not math.isnan(b_low), stated_test)
    return ResultsParagraph(
        " ".join([first, *sentences]),
        driving,
        settled,
        footnotes,
        caveats,
        intervals,
        ahead,
        verdict,
        side,
        tuple(sentences),
    )
