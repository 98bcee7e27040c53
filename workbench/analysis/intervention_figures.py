"""Figures of an intervention study: the block x head heatmap, branch bars, each head's map beside its effect.

Pure functions from numbers (``workbench.interventions.summary``) to matplotlib figures (no
pyplot); the report turns them into PNG bytes. Changes are accuracy points (intervened
minus intact); a colour scale centred on zero keeps drops and gains apart.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
from matplotlib.figure import Figure

from workbench.interventions.summary import InterventionRow

POINTS = 100.0


def _limit(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    # at least +-0.5 points: no scale from noise
    return max(float(finite.max()) if finite.size else 0.0, 0.5)


def heads_heatmap(matrices: dict[str, tuple[np.ndarray, np.ndarray]], title: str) -> Figure:
    """One panel per ablation mode: ``(depth, heads)`` mean change in points, ``*`` where the t-interval excludes zero.

    Args:
        matrices: mode -> (mean change as a fraction, t-interval excludes zero), from ``summary.head_matrix``.
    """
    depth, heads = next(iter(matrices.values()))[0].shape
    fig = Figure(
        figsize=(1.2 + 3.2 * len(matrices) * max(1.0, heads / 6), 1.4 + 0.45 * depth),
        dpi=100,
        layout="constrained",
    )
    axes = fig.subplots(1, len(matrices), squeeze=False)[0]
    limit = _limit(np.concatenate([m.ravel() for m, _ in matrices.values()]) * POINTS)
    image = None
    for ax, (mode, (mean, marked)) in zip(axes, matrices.items()):
        values = mean * POINTS
        image = ax.imshow(values, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
        for b in range(depth):
            for h in range(heads):
                if math.isfinite(values[b, h]):
                    text = f"{values[b, h]:+.1f}" + ("*" if marked[b, h] else "")
                    dark = abs(values[b, h]) > 0.6 * limit
                    ax.text(
                        h,
                        b,
                        text,
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )
        ax.set_xticks(range(heads), [str(h) for h in range(heads)])
        ax.set_yticks(range(depth), [str(b) for b in range(depth)])
        ax.set_xlabel("head")
        ax.set_ylabel("block")
        ax.set_title(f"{mode}-ablated", fontsize=9)
    fig.colorbar(image, ax=list(axes), label="accuracy change, points", shrink=0.9)
    fig.suptitle(title, fontsize=9)
    return fig


def effect_bars(rows: list[InterventionRow], title: str) -> Figure:
    """Horizontal bars: mean change per intervention, thick line = t-interval, thin = bootstrap, dots = seeds."""
    fig = Figure(figsize=(7.0, 1.0 + 0.38 * len(rows)), dpi=100, layout="constrained")
    ax = fig.subplots()
    y = np.arange(len(rows))[::-1]
    for yi, r in zip(y, rows):
        mean = r.paired.mean_difference * POINTS
        ax.barh(yi, mean, color="#c0392b" if mean < 0 else "#2471a3", alpha=0.55, height=0.6)
        if math.isfinite(r.paired.ci_low):
            ax.plot(
                [r.paired.ci_low * POINTS, r.paired.ci_high * POINTS],
                [yi, yi],
                color="black",
                lw=2.2,
            )
        if math.isfinite(r.bootstrap.low):
            ax.plot(
                [r.bootstrap.low * POINTS, r.bootstrap.high * POINTS],
                [yi + 0.18] * 2,
                color="0.35",
                lw=0.9,
            )
        ax.scatter(
            np.array(r.paired.differences) * POINTS, [yi] * r.paired.n, s=9, color="black", zorder=3
        )
    ax.axvline(0, color="0.3", lw=0.8)
    ax.set_yticks(y, [r.name for r in rows], fontsize=8)
    ax.set_xlabel("accuracy change against the intact model, points")
    ax.set_title(title, fontsize=9)
    return fig


def attention_beside_effects(
    maps: dict[int, np.ndarray], changes: dict[int, np.ndarray], query: str, title: str
) -> Figure:
    """Each head's mean attention map in each seed's model, titled with that head's zero-ablation effect there.

    Per seed, never averaged over seeds: the heads of separately trained seeds do not
    correspond by index, so a mean over seeds of "head 2" would blend unrelated heads.

    Args:
        maps: seed -> ``(depth, heads, rows, cols)`` mean attention onto the patches over the images.
        changes: seed -> ``(depth, heads)`` accuracy change (fraction) of that head zero-ablated.
        query: Which query the maps are of ("the class token", ...), for the title.
    """
    seeds = sorted(maps)
    depth, heads = maps[seeds[0]].shape[:2]
    fig = Figure(
        figsize=(0.9 + 1.3 * heads, 0.8 + 1.35 * depth * len(seeds)), dpi=100, layout="constrained"
    )
    axes = fig.subplots(depth * len(seeds), heads, squeeze=False)
    for i, seed in enumerate(seeds):
        for b in range(depth):
            row = i * depth + b
            for h in range(heads):
                ax = axes[row, h]
                ax.imshow(maps[seed][b, h], cmap="viridis")
                ax.set_xticks([])
                ax.set_yticks([])
                change = changes[seed][b, h] * POINTS
                ax.set_title(
                    f"h{h}: " + ("n/a" if not math.isfinite(change) else f"{change:+.2f}"),
                    fontsize=7,
                )
            axes[row, 0].set_ylabel(f"seed {seed}\nblock {b}", fontsize=7)
    note = (
        f"mean attention of {query} onto the patches (each map its own colour scale), one row per seed and block; "
        "above each map: the accuracy change in points in that seed when that head alone is zero-ablated"
    )
    fig.suptitle(f"{title}\n" + textwrap.fill(note, width=int(18 * fig.get_figwidth())), fontsize=7)
    return fig
