"""Report figures as PNG bytes: training curves, paired seed values, confusion matrices.

Figures are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas (no pyplot
state, no display) and saved without the "Software" metadata entry, so the same runs
give byte-identical files.
"""

from __future__ import annotations

import io

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from reports.collect import StudyData
from reports.tables import PerClass

DPI = 100
CURVE_TITLES = {"val_accuracy": "validation accuracy", "val_loss": "validation loss",
                "train_accuracy": "training accuracy", "train_loss": "training loss"}
STYLE = {"font.size": 9, "axes.spines.top": False, "axes.spines.right": False, "svg.hashsalt": "report"}


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _colors(arms: tuple[str, ...]) -> dict[str, tuple]:
    cmap = matplotlib.colormaps["tab10"]
    return {arm: cmap(i % 10) for i, arm in enumerate(arms)}


def curves(study: StudyData) -> bytes:
    """Per-epoch curves per arm: mean over the arm's seeds, band = mean ± 1 sample std.

    Runs stopped early have fewer epochs, so each epoch averages the seeds that reached it
    (no band where only one seed did).
    """
    colors = _colors(study.spec.arms)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(10, 6.4), layout="constrained")
        for ax, (key, title) in zip(fig.subplots(2, 2).ravel(), CURVE_TITLES.items()):
            for arm in study.spec.arms:
                series = [c.curves.get(key, {}) for (a, _), c in sorted(study.cells.items()) if a == arm]
                series = [s for s in series if s]
                if not series:
                    continue
                epochs = sorted(set().union(*series))
                values = [[s[e] for s in series if e in s] for e in epochs]
                mean = np.array([np.mean(v) for v in values])
                std = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values])
                scale = 100.0 if key.endswith("accuracy") else 1.0  # accuracies in %, as in the tables
                ax.plot(epochs, scale * mean, color=colors[arm], lw=1.8, label=f"{arm} (n={len(series)})", marker="o", ms=3)
                ax.fill_between(epochs, scale * (mean - std), scale * (mean + std), color=colors[arm], alpha=0.2, lw=0)
            ax.set_title(title + (" (%)" if key.endswith("accuracy") else ""))
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        fig.suptitle(f"{study.spec.name}@{study.spec.short_hash}: mean over seeds, band ±1 std")
        return _png(fig)


def paired_seeds(study: StudyData, split: str, values: dict[str, dict[int, float]]) -> bytes:
    """Each seed's accuracy in every arm, joined by a line: the pairing the comparisons rest on."""
    arms = study.spec.arms
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(1.6 + 1.4 * len(arms), 3.6), layout="constrained")
        ax = fig.subplots()
        seed_colors = matplotlib.colormaps["tab10"]
        for i, seed in enumerate(study.spec.seeds):
            xs = [j for j, arm in enumerate(arms) if seed in values.get(arm, {})]
            ys = [100 * values[arms[j]][seed] for j in xs]
            ax.plot(xs, ys, color=seed_colors(i % 10), marker="o", lw=1, alpha=0.8, label=f"seed {seed}")
        for j, arm in enumerate(arms):
            vals = list(values.get(arm, {}).values())
            if vals:
                ax.hlines(100 * np.mean(vals), j - 0.25, j + 0.25, color="black", lw=2)
        ax.set_xticks(range(len(arms)), [f"{a}\n(reference)" if a == study.spec.reference else a for a in arms])
        ax.set_xlim(-0.5, len(arms) - 0.5)
        ax.set_ylabel(f"{'validation' if split == 'val' else 'test'} accuracy (%)")
        ax.set_title("per seed (lines join a seed's arms; bar = mean)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        return _png(fig)


def confusion(per_class: list[PerClass], class_names: list[str], split: str) -> bytes:
    """Row-normalised confusion matrix per arm (counts summed over seeds, written in each cell)."""
    k = len(class_names)
    with matplotlib.rc_context(STYLE):
        size = 1.2 + 0.42 * k
        fig = Figure(figsize=(size * len(per_class) + 0.8, size + 0.6), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(per_class)))
        for ax, pc in zip(axes, per_class):
            counts = pc.confusion
            rows = counts.sum(axis=1, keepdims=True)
            share = np.divide(counts, rows, out=np.zeros(counts.shape), where=rows > 0)
            image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
            if k <= 12:  # counts stay readable up to about 12 classes
                for (i, j), c in np.ndenumerate(counts):
                    ax.text(j, i, str(c), ha="center", va="center", fontsize=7,
                            color="white" if share[i, j] > 0.6 else "black")
            ax.set_xticks(range(k), class_names, rotation=60, ha="right", fontsize=7)
            ax.set_yticks(range(k), class_names, fontsize=7)
            ax.set_xlabel("predicted")
            ax.set_ylabel("true")
            ax.set_title(f"{pc.arm} ({split}, {len(pc.seeds)} seeds summed)", fontsize=9)
        fig.colorbar(image, ax=list(axes), shrink=0.8, label="share of true class")
        return _png(fig)
