"""reports.content.forest: the forest plot renders and plots exactly its inputs."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from workbench import stats
from reports.content.forest import ForestRow, figure_png, forest_plot, forest_rows


def by_gid(fig: Figure) -> dict:
    return {
        a.get_gid(): a for ax in fig.axes for a in list(ax.lines) + list(ax.texts) if a.get_gid()
    }


def test_forest_plot_values_equal_inputs_and_render():
    rng = np.random.default_rng(0)
    ref = {s: 0.80 + rng.normal(0, 0.01) for s in range(3)}
    arms = {
        f"arm{i}": {s: ref[s] + 0.01 * i + rng.normal(0, 0.01) for s in range(3)}
        for i in range(1, 11)
    }
    comps = {a: stats.paired_seed_comparison(v, ref, names=(a, "base")) for a, v in arms.items()}
    # arm3 without a bootstrap
    boots = {
        a: stats.CI(c.mean_difference, c.mean_difference - 0.004, c.mean_difference + 0.004, 2000)
        for a, c in comps.items()
        if a != "arm3"
    }
    rows = forest_rows(comps, boots)
    fig = forest_plot(rows, "base")
    artists = by_gid(fig)
    worst = 0.0
    for a, c in comps.items():
        mean = artists[f"mean:{a}"].get_xdata()
        t = artists[f"t:{a}"].get_xdata()
        worst = max(
            worst,
            abs(mean[0] - 100 * c.mean_difference),
            abs(t[0] - 100 * c.ci_low),
            abs(t[1] - 100 * c.ci_high),
        )
        if a in boots:
            b = artists[f"boot:{a}"].get_xdata()
            worst = max(worst, abs(b[0] - 100 * boots[a].low), abs(b[1] - 100 * boots[a].high))
        else:
            assert f"boot:{a}" not in artists
        assert artists[f"wins:{a}"].get_text() == f"wins {c.wins} of 3"
    assert worst < 1e-9, f"plotted values differ from inputs by {worst:.3g}"
    # Row order: the first arm on top.
    ys = [artists[f"mean:arm{i}"].get_ydata()[0] for i in range(1, 11)]
    assert ys == sorted(ys, reverse=True)
    png = figure_png(fig)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert png == figure_png(forest_plot(rows, "base")), "same rows must give the same bytes"


def test_forest_plot_without_interval_says_so():
    fig = forest_plot([ForestRow("solo", 0.01, math.nan, math.nan, wins=1, n=1)], "ref")
    artists = by_gid(fig)
    assert (
        "t:solo" not in artists and artists["wins:solo"].get_text() == "wins 1 of 1 (no t-interval)"
    )
    assert figure_png(fig)[:4] == b"\x89PNG"
