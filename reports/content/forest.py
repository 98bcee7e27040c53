"""Forest plot: every arm against the reference, both intervals, wins k of n.

One row per arm: the mean paired difference (arm - reference) as a dot, the between-seed
Student-t interval as a thick bar, the hierarchical bootstrap interval as a thin bar just
below it, and "wins k of n" (seeds where the arm is ahead) on the right. A vertical line marks zero. Drawn on a bare
``matplotlib.figure.Figure`` (no pyplot state), so it is safe in any process. Every data
artist carries a ``gid`` (``mean:<arm>``, ``t:<arm>``, ``boot:<arm>``, ``wins:<arm>``) so
tests and renderers can find exactly what was plotted.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

T_COLOR, BOOT_COLOR = "#1f77b4", "#ff7f0e"


@dataclass(frozen=True)
class ForestRow:
    """One arm's paired difference against the reference (unscaled, e.g. accuracy in [0, 1])."""

    arm: str
    mean_difference: float
    t_low: float
    t_high: float
    boot_low: float = math.nan
    boot_high: float = math.nan
    wins: int = 0
    n: int = 0
    ties: int = 0


def forest_rows(
    comparisons: Mapping[str, Any], bootstraps: Mapping[str, Any] | None = None
) -> list[ForestRow]:
    """Rows from ``PairedComparison`` objects (arm -> arm minus reference) and optional bootstrap CIs."""
    rows = []
    for arm, c in comparisons.items():
        b = (bootstraps or {}).get(arm)
        rows.append(
            ForestRow(
                arm,
                float(c.mean_difference),
                float(c.ci_low),
                float(c.ci_high),
                math.nan if b is None else float(b.low),
                math.nan if b is None else float(b.high),
                int(c.wins),
                int(c.n),
                int(c.ties),
            )
        )
    return rows


def _finite(*xs: float) -> bool:
    return all(math.isfinite(x) for x in xs)


def forest_plot(
    rows: Sequence[ForestRow],
    reference: str,
    *,
    scale: float = 100.0,
    unit: str = "points",
    metric: str = "accuracy",
    confidence: float = 0.95,
    title: str | None = None,
    xlabel: str | None = None,
) -> Figure:
    """Draw the forest plot; returns the Figure (render with ``figure_png``).

    Args:
        rows: One per arm, top to bottom in the given order.
        reference: The reference arm's name (axis label).
        scale, unit: Display scale of the differences (100, "points").
        metric: The metric's name in words.
        confidence: Level of both intervals, for the legend.
        title: Figure title; default names the metric and the reference.
        xlabel: The x-axis label; default "<metric>: arm minus <reference> (<unit>)" (an
            interaction plot names its difference of differences instead).
    """
    if not rows:
        raise ValueError("forest_plot: no rows")
    fig = Figure(figsize=(7.0, 1.2 + 0.45 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    labels = []
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i  # first row on top
        if _finite(r.t_low, r.t_high):
            ax.plot(
                [r.t_low * scale, r.t_high * scale],
                [y, y],
                color=T_COLOR,
                lw=3.5,
                solid_capstyle="butt",
                gid=f"t:{r.arm}",
                label=f"{confidence:.0%} t-interval (seeds)" if i == 0 else None,
            )
        if _finite(r.boot_low, r.boot_high):
            ax.plot(
                [r.boot_low * scale, r.boot_high * scale],
                [y - 0.22, y - 0.22],
                color=BOOT_COLOR,
                lw=1.5,
                gid=f"boot:{r.arm}",
                label=f"{confidence:.0%} bootstrap (seeds, examples)" if i == 0 else None,
            )
        ax.plot(
            [r.mean_difference * scale],
            [y],
            "o",
            color="black",
            ms=5,
            gid=f"mean:{r.arm}",
            label="mean paired difference" if i == 0 else None,
        )
        ties = f", {r.ties} tied" if r.ties else ""
        note = "" if _finite(r.t_low, r.t_high) else " (no t-interval)"
        ax.text(
            1.01,
            y,
            f"wins {r.wins} of {r.n}{ties}{note}",
            transform=ax.get_yaxis_transform(),
            va="center",
            fontsize=8,
            gid=f"wins:{r.arm}",
        )
        labels.append(r.arm)
    ax.axvline(0.0, color="0.4", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows) - 1, -1, -1), labels)
    ax.set_ylim(-0.8, len(rows) - 0.4)
    ax.set_xlabel(
        xlabel
        or (
            f"{metric}: arm minus {reference} ({unit})"
            if unit
            else f"{metric}: arm minus {reference}"
        )
    )
    # A figure title, not an axes title: the legend sits just above the axes and would cover it.
    fig.suptitle(title or f"Paired differences against {reference}", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=3, fontsize=7, frameon=False)
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """PNG bytes of a Figure, without the "Software" metadata (same input, same bytes)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()
