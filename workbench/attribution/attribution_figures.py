"""Figures of an attribution study: deletion and insertion curves, example maps beside the causal effect, token norms.

Pure functions from arrays (``workbench.attribution``) to matplotlib figures (Agg, no pyplot);
the report turns them into PNG bytes (``common.png_bytes``). They live here rather than in
``workbench/analysis/``, which already holds its 12 modules (tests/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from workbench.analysis.common import new_figure, show_image

BASELINE = "random"


def _style(method: str) -> dict:
    return dict(color="0.45", linestyle="--") if method == BASELINE else {}


def curves_figure(
    fractions: np.ndarray,
    deletion: Mapping[str, np.ndarray],
    insertion: Mapping[str, np.ndarray],
    title: str,
    ylabel: str = "true-class probability",
) -> Figure:
    """Deletion and insertion curves of every method: the mean over seeds, a band from the lowest to the highest seed.

    Args:
        fractions: ``(K,)`` fraction of patch tokens removed (deletion) or kept (insertion), 0 to 1.
        deletion, insertion: method -> ``(seeds, K)`` each seed's curve (its mean over images).
            One seed draws a line without a band.
    """
    f = np.asarray(fractions, dtype=np.float64)
    fig = new_figure((10.0, 4.0))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (kind, curves) in zip(axes, (("deletion", deletion), ("insertion", insertion))):
        for method, per_seed in curves.items():
            values = np.atleast_2d(np.asarray(per_seed, dtype=np.float64))
            if values.shape[1] != f.size:
                raise ValueError(
                    f"{kind} curve of {method!r} has {values.shape[1]} points, the fractions {f.size}"
                )
            mean = values.mean(axis=0)
            area = float((np.diff(f) * (mean[1:] + mean[:-1]) / 2).sum())
            (line,) = ax.plot(f, mean, label=f"{method} (AUC {area:.3f})", **_style(method))
            if values.shape[0] > 1:
                ax.fill_between(
                    f,
                    values.min(axis=0),
                    values.max(axis=0),
                    color=line.get_color(),
                    alpha=0.18,
                    linewidth=0,
                )
        word = "removed" if kind == "deletion" else "kept"
        ax.set_xlabel(f"fraction of patch tokens {word}, most important first")
        ax.set_title(
            f"{kind} (lower AUC is better)"
            if kind == "deletion"
            else f"{kind} (higher AUC is better)",
            fontsize=9,
        )
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(ylabel)
    seeds = max(
        np.atleast_2d(np.asarray(v)).shape[0] for v in [*deletion.values(), *insertion.values()]
    )
    band = f"; band: lowest to highest of {seeds} seeds" if seeds > 1 else ""
    fig.suptitle(f"{title} (mean over seeds{band}; AUC: trapezoid over 0..1)", fontsize=9)
    return fig


def example_maps_figure(
    images: np.ndarray,
    maps: Mapping[str, np.ndarray],
    effects: np.ndarray,
    titles: Sequence[str] | None = None,
) -> Figure:
    """One row per image: the image, each method's map, the exact single-token drop's effect map.

    Args:
        images: ``(n, H, W, C)`` floats in [0, 1] (``common.display_images``).
        maps: method -> ``(n, rows, cols)`` scores; a method with any negative score (gradient x
            input) is drawn on scales centred on 0, the others from each map's minimum to maximum.
        effects: ``(n, rows, cols)`` ``log p_full(y) - log p_without(y)``, on a scale centred on 0.
        titles: One caption per image (e.g. its true and predicted class).
    """
    n = images.shape[0]
    signed = {name: bool(np.asarray(values).min() < 0) for name, values in maps.items()}
    signed["causal effect"] = True
    columns = 2 + len(maps)
    fig = new_figure((1.6 * columns + 0.6, 1.7 * n + 0.5))
    axes = np.atleast_2d(fig.subplots(n, columns, squeeze=False))
    for i in range(n):
        show_image(axes[i, 0], images[i])
        if titles is not None:
            axes[i, 0].set_title(titles[i], fontsize=7)
        panels = [*maps.items(), ("causal effect", effects)]
        for j, (name, values) in enumerate(panels, start=1):
            v = np.asarray(values[i], dtype=np.float64)
            ax = axes[i, j]
            if signed[name]:
                limit = max(float(np.abs(v).max()), 1e-12)
                ax.imshow(v, cmap="RdBu_r", vmin=-limit, vmax=limit)
            else:
                ax.imshow(v, cmap="viridis")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(name, fontsize=8)
    fig.suptitle(
        "Each method's map beside the exact causal effect of removing each patch token alone "
        "(red: the token helped the true class)",
        fontsize=8,
    )
    return fig


def norm_histograms_figure(norms: np.ndarray, median: np.ndarray, k: float, title: str) -> Figure:
    """Per block, the histogram of patch-token norms (log-spaced bins), the ``k x median`` cut-off marked.

    Args:
        norms: ``(B, L, P)`` L2 norms of the patch tokens after each block.
        median: ``(L,)`` each block's median norm.
    """
    depth = norms.shape[1]
    fig = new_figure((min(3.0 * depth, 15.0) + 0.5, 3.0))
    axes = fig.subplots(1, depth, squeeze=False)[0]
    for block, ax in enumerate(axes):
        values = norms[:, block].ravel()
        cut = k * float(median[block])
        low, high = max(float(values.min()), 1e-12), max(float(values.max()), cut) * 1.05
        ax.hist(values, bins=np.geomspace(low, high, 40), color="0.35")
        ax.axvline(cut, color="tab:red", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        share = float((values > cut).mean())
        ax.set_title(f"block {block}: {share:.2%} above {k:g} x median", fontsize=8)
        ax.set_xlabel("patch-token L2 norm")
    axes[0].set_ylabel("tokens")
    fig.suptitle(title, fontsize=9)
    return fig


def concentration_figure(
    panels: Mapping[str, Mapping[str, np.ndarray]],
    title: str,
    reference: Mapping[str, Mapping[str, float]] | None = None,
) -> Figure:
    """One panel per measure of CLS attention against the block: per line, the mean over seeds and the seeds' range.

    Args:
        panels: panel title -> {line label -> ``(seeds, L)`` per seed and block}.
        reference: panel title -> {label -> value} drawn as dotted lines (e.g. uniform attention's).
    """
    fig = new_figure((3.4 * len(panels) + 0.4, 3.0))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, lines) in zip(axes, panels.items()):
        for label, per_seed in lines.items():
            values = np.atleast_2d(np.asarray(per_seed, dtype=np.float64))
            blocks = np.arange(values.shape[1])
            (line,) = ax.plot(blocks, values.mean(axis=0), marker="o", markersize=3, label=label)
            if values.shape[0] > 1:
                ax.fill_between(
                    blocks,
                    values.min(axis=0),
                    values.max(axis=0),
                    color=line.get_color(),
                    alpha=0.18,
                    linewidth=0,
                )
        for label, value in (reference or {}).get(name, {}).items():
            ax.axhline(value, color="0.45", linestyle=":", linewidth=1, label=label)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("block")
        ax.set_xticks(blocks)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    return fig


def per_class_figure(
    values: np.ndarray, methods: Sequence[str], classes: Sequence[str], title: str
) -> Figure:
    """Heat map of one measure per method (rows) and true class (columns), centred on zero.

    Args:
        values: ``(methods, classes)`` the mean over seeds of each class's mean (NaN: no image).
    """
    v = np.asarray(values, dtype=np.float64)
    fig = new_figure((0.75 * len(classes) + 2.6, 0.45 * len(methods) + 1.3))
    ax = fig.subplots()
    finite = np.abs(v[np.isfinite(v)])
    limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    image = ax.imshow(v, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(len(classes)), list(classes), rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(methods)), list(methods), fontsize=8)
    for (i, j), x in np.ndenumerate(v):
        if np.isfinite(x):
            ax.text(j, i, f"{x:+.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, shrink=0.8)
    ax.set_title(title, fontsize=9)
    return fig


def sanity_figure(per_step: Mapping[str, Sequence[float]], threshold: float, title: str) -> Figure:
    """Each map's mean rank correlation with itself against the number of blocks randomised (top down)."""
    fig = new_figure((5.5, 3.4))
    ax = fig.subplots()
    for method, values in per_step.items():
        steps = np.arange(1, len(values) + 1)
        ax.plot(steps, values, marker="o", label=method, **_style(method))
    ax.axhline(threshold, color="0.3", linestyle=":", linewidth=1)
    ax.axhline(0.0, color="0.7", linewidth=0.8)
    ax.set_xlabel("blocks randomised, from the last block down")
    ax.set_ylabel("Spearman ρ with the trained model's map")
    ax.set_ylim(-1.05, 1.05)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return fig


def randomisation_figure(
    per_step: Mapping[tuple[str, str, str], Sequence[float]],
    layers: Sequence[str],
    threshold: float,
    title: str,
) -> Figure:
    """Adebayo et al.'s check: rows cascading / independent, columns rho / |rho| / SSIM; one line per map.

    ``per_step``: ``(mode, metric, method) -> values per step`` (step k: ``layers[k]``).
    """
    modes, metrics = ("cascade", "independent"), ("rho", "abs_rho", "ssim")
    words = {"rho": "Spearman ρ", "abs_rho": "Spearman ρ of |map|", "ssim": "SSIM"}
    fig = new_figure((12.0, 6.4))
    axes = fig.subplots(len(modes), len(metrics), sharey=True, squeeze=False)
    steps = np.arange(len(layers))
    for i, mode in enumerate(modes):
        for j, metric in enumerate(metrics):
            ax = axes[i][j]
            for (m_mode, m_metric, method), values in per_step.items():
                if (m_mode, m_metric) == (mode, metric):
                    ax.plot(steps, values, marker="o", label=method, **_style(method))
            if metric == "rho":
                ax.axhline(threshold, color="0.3", linestyle=":", linewidth=1)
            ax.axhline(0.0, color="0.7", linewidth=0.8)
            ax.set_xticks(steps, list(layers), rotation=45, ha="right", fontsize=7)
            ax.set_ylim(-1.05, 1.05)
            ax.set_title(f"{mode}: {words[metric]}", fontsize=9)
    axes[0][0].set_ylabel("against the trained model's map")
    axes[1][0].set_ylabel("against the trained model's map")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig
