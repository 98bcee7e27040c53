"""The benchmarks' shared verdict: faster / slower / not resolved from per-round timings, and ``use:``."""

from __future__ import annotations

import math

import pytest

from workbench.bench.timing import (
    Load,
    compare,
    decide,
    goal_verdict,
    rounds_needed,
    sign_interval,
    use_line,
)


def test_sign_interval_needs_six_rounds_at_95_percent():
    assert rounds_needed() == 6
    assert all(math.isnan(x) for x in sign_interval([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert sign_interval([3.0, 1.0, 2.0, 6.0, 4.0, 5.0]) == (1.0, 6.0)
    # 20 rounds: P(Bin(20, 1/2) <= 5) = 0.0207 <= 0.025 < P(<= 6), so the 6th smallest to 6th largest.
    assert sign_interval([float(i) for i in range(20)]) == (5.0, 14.0)


def test_clearly_faster_is_faster_and_chosen():
    today = [1.00, 1.10, 0.95, 1.05, 1.20, 0.98, 1.02, 1.01]
    fast = [t * f for t, f in zip(today, (0.70, 0.72, 0.69, 0.75, 0.71, 0.74, 0.70, 0.73))]
    seconds = {"today": today, "fast": fast}
    v = compare(seconds, "fast", "today")
    assert v.word == "faster", v.line
    assert abs(v.ratio - 0.715) < 1e-9, v.ratio  # the median of the eight ratios
    assert v.high < 1.0, (v.low, v.high)
    assert compare(seconds, "today", "fast").word == "slower"
    assert use_line(seconds, ["today", "fast"]).startswith("use: fast (resolved faster than today")


def test_overlapping_rounds_are_not_resolved():
    today = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    other = [0.8, 1.1, 0.9, 1.3, 0.85, 1.2, 0.95, 1.05]  # ratios on both sides of 1
    seconds = {"today": today, "other": other}
    v = compare(seconds, "other", "today")
    assert v.word == "not resolved", v.line
    assert v.low < 1.0 < v.high, (v.low, v.high)
    assert "not resolved at this noise" in v.line
    assert use_line(seconds, ["today", "other"]) == "use: either (not resolved)"


def test_too_few_rounds_are_never_resolved():
    seconds = {"a": [1.0] * 5, "b": [0.5] * 5}  # every round 2x faster, but only 5 rounds
    v = compare(seconds, "b", "a")
    assert v.word == "not resolved" and "6 needed" in v.line, v.line
    assert use_line(seconds, ["a", "b"]) == "use: either (not resolved)"


def test_use_names_the_unresolved_set_without_the_resolved_slower():
    n = 7
    seconds = {"a": [1.0] * n, "b": [1.0 + 0.01 * (-1) ** i for i in range(n)], "c": [2.0] * n}
    assert use_line(seconds, ["a", "b", "c"]) == "use: a or b (not resolved between them)"
    assert use_line(seconds, ["a"]) == "use: a (the only option timed)"


def test_decide_proposes_only_choices_and_reports_spread_metrics_and_tags():
    n = 6
    seconds = {"today": [1.0] * n, "fused": [0.8] * n, "probe": [0.1] * n}
    d = decide(seconds, "today", choices=["today", "fused"], scope="base")
    assert [v.name for v in d.verdicts] == ["fused", "probe"]
    assert d.use.startswith("use: fused"), d.use  # the probe is faster but not a choice
    assert d.spreads["fused"].min == pytest.approx(0.8)
    m = d.metrics()
    assert m["verdict/base/fused_vs_today/ratio"] == pytest.approx(0.8)
    assert m["verdict/base/fused_vs_today/resolved"] == 1.0
    assert d.tags()["use.base"].startswith("fused")
    assert d.tags()["verdict.base.fused_vs_today"] == "faster"
    assert d.lines[-1] == f"base: {d.use}" and "rounds' spread" in d.lines[0]
    with pytest.raises(ValueError, match="reference 'x'"):
        decide(seconds, "x")


def test_load_records_start_and_end():
    load = Load.begin().finish()
    assert load.cores >= 1
    assert "at the start" in load.line and "on" in load.line
    assert set(load.as_dict()) == {"load_start", "load_end", "cores"}


def test_goal_verdict_is_met_missed_or_not_resolved_from_the_units_spread():
    cells = [50.0, 52.0, 55.0, 51.0, 58.0, 53.0]  # seconds per cell; 5 cells: 250 to 290 s
    assert goal_verdict(cells, 5, 300.0).startswith("met ("), goal_verdict(cells, 5, 300.0)
    assert goal_verdict(cells, 5, 200.0).startswith("missed ("), goal_verdict(cells, 5, 200.0)
    assert goal_verdict(cells, 5, 270.0).startswith("not resolved at this noise")
    assert "6 needed" in goal_verdict(cells[:3], 5, 300.0)
