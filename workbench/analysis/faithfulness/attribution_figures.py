"""Figures of an attribution study: deletion and insertion curves, example maps, token-norm histograms.

Pure functions from arrays (the per-image arrays each cell logged) to matplotlib figures (no
pyplot); the report turns them into PNG bytes. Curves are seed means of the per-image
true-class probability; bands are the range over seeds (min to max), not an interval.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

# One colour per method, the random baseline grey and dashed.
COLOURS = {"cls_attention": "tab:blue", "rollout": "tab:orange", "chefer": "tab:green", "grad_x_input": "tab:purple",
           "random": "0.45"}


def perturbation_curves(curves: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], title: str) -> Figure:
    """Two panels, deletion and insertion: per method the mean over seeds with the range over seeds as a band.

    Args:
        curves: kind (``deletion``, ``insertion``) -> method -> (fractions ``(F,)``, per seed ``(S, F)`` means).
    """
    fig = Figure(figsize=(9.0, 3.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    for ax, (kind, methods) in zip(axes, curves.items()):
        for method, (fractions, per_seed) in methods.items():
            colour = COLOURS.get(method, "black")
            style = "--" if method == "random" else "-"
            ax.plot(fractions, per_seed.mean(axis=0), style, color=colour, lw=1.6, label=method)
            if per_seed.shape[0] > 1:
                ax.fill_between(fractions, per_seed.min(axis=0), per_seed.max(axis=0), color=colour, alpha=0.15, lw=0)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("fraction of patch tokens " + ("removed" if kind == "deletion" else "kept"))
        ax.set_ylabel("true-class probability")
        ax.set_title(f"{kind} (most important first)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    return fig


def _display(image: np.ndarray) -> np.ndarray:
    """``(C, H, W)`` model input -> ``(H, W[, 3])`` in 0..1, min-max scaled per image."""
    x = image.astype(np.float64)
    x = (x - x.min()) / (x.max() - x.min()) if x.max() > x.min() else np.zeros_like(x)
    return x[0] if x.shape[0] == 1 else np.transpose(x[:3], (1, 2, 0))


def example_maps(images: np.ndarray, effects: np.ndarray, scores: dict[str, np.ndarray], grid: tuple[int, int],
                 labels: np.ndarray, title: str) -> Figure:
    """One row per image: the image, the causal-effect map, then each method's map on the patch grid.

    Args:
        images: ``(E, C, H, W)`` as the model saw them; ``effects`` ``(E, P)``; ``scores`` method -> ``(E, P)``.
        grid: Patches per side (rows, cols); ``labels`` ``(E,)`` true classes.
    """
    rows, cols = len(images), 2 + len(scores)
    fig = Figure(figsize=(1.5 * cols, 1.55 * rows + 0.5), dpi=100, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for r in range(rows):
        shown = _display(images[r])
        axes[r, 0].imshow(shown, cmap="gray" if shown.ndim == 2 else None)
        axes[r, 0].set_ylabel(f"class {int(labels[r])}", fontsize=8)
        effect = effects[r].reshape(grid)
        limit = max(float(np.abs(effect).max()), 1e-12)
        axes[r, 1].imshow(effect, cmap="RdBu_r", vmin=-limit, vmax=limit)
        for c, (method, values) in enumerate(scores.items(), start=2):
            axes[r, c].imshow(values[r].reshape(grid), cmap="viridis")
            if r == 0:
                axes[r, c].set_title(method, fontsize=8)
        if r == 0:
            axes[r, 0].set_title("image", fontsize=8)
            axes[r, 1].set_title("causal effect", fontsize=8)
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    return fig


def norm_histograms(ratios: list[np.ndarray], threshold: float, title: str) -> Figure:
    """One panel per block: histogram of every patch token's norm divided by the block's median (log counts).

    Args:
        ratios: Per block, the ratios of every token of every image and seed.
        threshold: k; tokens right of the dashed line are high-norm.
    """
    depth = len(ratios)
    per_row = min(depth, 4)
    n_rows = -(-depth // per_row)
    fig = Figure(figsize=(2.6 * per_row, 2.2 * n_rows + 0.4), dpi=100, layout="constrained")
    axes = fig.subplots(n_rows, per_row, squeeze=False).ravel()
    top = max(threshold * 1.2, max(float(r.max()) for r in ratios) * 1.05)
    bins = np.linspace(0.0, top, 60)
    for block, ax in enumerate(axes):
        if block >= depth:
            ax.set_visible(False)
            continue
        ax.hist(ratios[block], bins=bins, color="tab:blue", alpha=0.8)
        ax.axvline(threshold, color="tab:red", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_title(f"block {block}", fontsize=9)
        ax.set_xlabel("norm / block median", fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig
