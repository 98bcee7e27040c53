"""Figures of training results: curves, confusion matrices, per-class accuracy, t-SNE, summary.

Inputs are plain arrays and dicts keyed by arm and seed, so these work on anything that
produced predictions and per-epoch metrics; ``tracking.kinds.figure_runs`` reads them from MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from workbench.analysis.common import DPI, footer, new_figure, wrap

CURVE_METRICS = ("val_accuracy", "val_loss", "train_accuracy", "train_loss")


def arm_colors(arms: Sequence[str]) -> dict[str, tuple]:
    """One stable colour per arm, in the order given: tab10, or tab20 for more than ten arms."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(arms) <= 10 else "tab20"]
    return {arm: cmap(i % cmap.N) for i, arm in enumerate(arms)}


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """``(K, K)`` counts, rows = true class, columns = predicted class."""
    out = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(out, (np.asarray(labels, dtype=np.int64), np.asarray(predicted, dtype=np.int64)), 1)
    return out


def per_class_accuracy(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """``(K,)`` accuracy per true class; NaN for a class with no examples."""
    cm = confusion_matrix(labels, predicted, num_classes)
    totals = cm.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(totals > 0, np.diag(cm) / totals, np.nan)


def curves_figure(
    histories: Mapping[str, Mapping[int, Mapping[str, Mapping[int, float]]]],
    metrics: Sequence[str] = CURVE_METRICS,
    title: str = "Training curves",
    dpi: int = DPI,
) -> Figure:
    """Per-epoch metrics: mean over seeds with a min-max band, one colour per arm.

    Args:
        histories: ``arm -> seed -> metric -> epoch -> value``.
        metrics: Metric keys, one panel each (at most four).
        title: Figure title.
        dpi: Resolution.
    """
    colors = arm_colors(list(histories))
    fig = new_figure((11.0, 7.5), dpi)
    axes = fig.subplots(2, 2, squeeze=False).ravel()
    for ax, metric in zip(axes, metrics):
        for arm, seeds in histories.items():
            series = [s[metric] for s in seeds.values() if s.get(metric)]
            if not series:
                continue
            epochs = sorted({e for s in series for e in s})
            # Early stopping ends seeds at different epochs: average the seeds present.
            values = [[s[e] for s in series if e in s] for e in epochs]
            mean = np.array([np.mean(v) for v in values])
            low, high = np.array([min(v) for v in values]), np.array([max(v) for v in values])
            ax.plot(
                epochs,
                mean,
                color=colors[arm],
                label=f"{arm} (mean of {len(series)} seeds)",
                marker="o",
                ms=3,
            )
            ax.fill_between(epochs, low, high, color=colors[arm], alpha=0.2, linewidth=0)
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    fig.suptitle(wrap(title, fig, 11), fontsize=11)
    footer(
        fig,
        "Line: mean over seeds at each epoch; band: min to max over seeds (seeds that stopped early drop out).",
    )
    return fig


def confusion_figure(
    matrices: Mapping[str, np.ndarray],
    class_names: Sequence[str],
    title: str = "Confusion matrices",
    ncols: int | None = None,
    dpi: int = DPI,
) -> Figure:
    """Panels of confusion matrices: colour = share of the true class (row), text = count.

    Args:
        matrices: Panel title -> ``(K, K)`` counts (e.g. summed over an arm's seeds).
        class_names: In label order.
        title: Figure title.
        ncols: Panels per row (default: all in one row, at most 3).
        dpi: Resolution.
    """
    n = len(matrices)
    ncols = ncols or min(n, 3)
    nrows = -(-n // ncols)
    k = len(class_names)
    fig = new_figure((round(5.4 * ncols, 2), round(5.6 * nrows + 0.6, 2)), dpi)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (name, cm) in zip(axes, matrices.items()):
        share = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
        ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
        for r in range(k):
            for c in range(k):
                ax.text(
                    c,
                    r,
                    str(int(cm[r, c])),
                    ha="center",
                    va="center",
                    fontsize=7 if k > 8 else 8,
                    color="white" if share[r, c] > 0.5 else "black",
                )
        ax.set_xticks(range(k), class_names, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(k), class_names, fontsize=7)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        accuracy = np.trace(cm) / max(cm.sum(), 1)
        ax.set_title(f"{name}\naccuracy {accuracy:.1%} of {int(cm.sum()):,}", fontsize=9)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(wrap(title, fig, 11), fontsize=11)
    return fig


def per_class_accuracy_figure(
    per_arm: Mapping[str, np.ndarray],
    class_names: Sequence[str],
    title: str = "Per-class accuracy",
    dpi: int = DPI,
) -> Figure:
    """Grouped bars: mean per-class accuracy per arm, with one dot per seed.

    Args:
        per_arm: Arm -> ``(seeds, K)`` per-class accuracies.
        class_names: In label order.
        title: Figure title.
        dpi: Resolution.
    """
    colors = arm_colors(list(per_arm))
    k, n = len(class_names), len(per_arm)
    width = 0.8 / max(n, 1)
    fig = new_figure((11.0, 5.0), dpi)
    ax = fig.subplots()
    x = np.arange(k)
    for i, (arm, acc) in enumerate(per_arm.items()):
        acc = np.atleast_2d(acc)
        pos = x - 0.4 + width * (i + 0.5)
        ax.bar(
            pos,
            np.nanmean(acc, axis=0),
            width,
            color=colors[arm],
            alpha=0.75,
            label=f"{arm} ({len(acc)} seeds)",
        )
        for seed_row in acc:
            ax.scatter(pos, seed_row, s=9, color="black", zorder=3, linewidths=0)
    ax.set_xticks(x, class_names, rotation=30, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(wrap(title, fig, 11), fontsize=11)
    footer(fig, "Bar: mean over seeds; dot: one seed.")
    return fig


def tsne_figure(
    panels: Mapping[str, tuple[np.ndarray, np.ndarray]],
    class_names: Sequence[str],
    title: str = "t-SNE",
    note: str = "",
    dpi: int = DPI,
) -> Figure:
    """Scatter of 2-D embeddings coloured by true class, one panel per model.

    Args:
        panels: Panel title -> (points ``(N, 2)``, labels ``(N,)``).
        class_names: In label order.
        title: Figure title.
        note: Footer text (e.g. t-SNE settings and a caution on reading distances).
        dpi: Resolution.
    """
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(class_names) <= 10 else "tab20"]
    n = len(panels)
    fig = new_figure((round(5.6 * n + 1.8, 2), 5.8), dpi)
    axes = fig.subplots(1, n, squeeze=False).ravel()
    for ax, (name, (points, labels)) in zip(axes, panels.items()):
        size = float(np.clip(4000 / max(len(points), 1), 6, 30))  # bigger dots when there are few
        for k, cls in enumerate(class_names):
            sel = labels == k
            ax.scatter(
                points[sel, 0],
                points[sel, 1],
                s=size,
                color=cmap(k % cmap.N),
                label=cls,
                alpha=0.8,
                linewidths=0,
            )
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside right center",
        fontsize=8,
        markerscale=max(1.0, 15 / size),
    )
    fig.suptitle(wrap(title, fig, 11), fontsize=11)
    if note:
        footer(fig, note)
    return fig


@dataclass
class ArmHeadline:
    """Headline numbers of one arm.

    Attributes:
        arm: Arm name.
        model: Model description (e.g. ``fmnist_vit``).
        parameters: Trainable parameter count.
        accuracy: Split -> seed -> accuracy.
        epochs: Seed -> epochs trained.
    """

    arm: str
    model: str
    parameters: int
    accuracy: dict[str, dict[int, float]] = field(default_factory=dict)
    epochs: dict[int, int] = field(default_factory=dict)


def summary_figure(
    arms: Sequence[ArmHeadline], title: str, note: str = "", dpi: int = DPI
) -> Figure:
    """Headline numbers in one figure: accuracy per arm and split with per-seed points, and a table.

    Args:
        arms: One summary per arm, reference first.
        title: Figure title.
        note: Footer text.
        dpi: Resolution.
    """
    colors = arm_colors([a.arm for a in arms])
    splits = [s for s in ("val", "test") if any(s in a.accuracy for a in arms)]
    # The table needs a line per arm: the figure grows with the study instead of cutting it off.
    table_height = 0.32 * (len(arms) + 1) + 0.3
    fig = new_figure((max(12.0, 0.75 * len(arms) * len(splits) + 2), 5.0 + table_height), dpi)
    top, bottom = fig.subfigures(2, 1, height_ratios=[4.4, table_height])
    ax = top.subplots()
    all_values = [v for a in arms for d in a.accuracy.values() for v in d.values()]
    span = (max(all_values, default=1.0) - min(all_values, default=0.0)) or 0.05
    for si, split in enumerate(splits):
        for ai, a in enumerate(arms):
            values = list(a.accuracy.get(split, {}).values())
            if not values:
                continue
            x = si * (len(arms) + 1) + ai
            mean = float(np.mean(values))
            ax.bar(x, mean, color=colors[a.arm], alpha=0.5, width=0.8)
            ax.scatter([x] * len(values), values, color="black", s=16, zorder=3)
            # the label sits above the highest seed so it never hides a point
            ax.text(
                x, max(values) + 0.04 * span, f"{mean:.1%}", ha="center", va="bottom", fontsize=9
            )
    # Every bar carries its arm's name (a legend would cover bars once there are many arms);
    # each split's group is named above it.
    ax.set_xticks(
        [si * (len(arms) + 1) + ai for si in range(len(splits)) for ai in range(len(arms))],
        [a.arm for _ in splits for a in arms],
        rotation=45 if len(arms) > 4 else 0,
        ha="right" if len(arms) > 4 else "center",
        fontsize=8,
    )
    for si, split in enumerate(splits):
        ax.text(
            si * (len(arms) + 1) + (len(arms) - 1) / 2,
            1.0,
            f"{split} accuracy",
            ha="center",
            va="bottom",
            fontsize=9,
            transform=ax.get_xaxis_transform(),
        )
    ax.set_ylim(
        max(0.0, min(all_values, default=0.0) - 0.5 * span),
        min(1.0, max(all_values, default=1.0) + 0.3 * span),
    )
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(
        "bar: mean over seeds (value above); dot: one seed; y axis zoomed to the data",
        fontsize=9,
        pad=16,
    )
    header = ["arm", "model", "parameters", "seeds", "epochs per seed"] + [
        f"{s} accuracy, mean ± sd" for s in splits
    ]
    rows = []
    for a in arms:
        seeds = sorted({seed for d in a.accuracy.values() for seed in d})
        cells = [
            a.arm,
            a.model,
            f"{a.parameters:,}",
            ", ".join(map(str, seeds)),
            ", ".join(str(a.epochs[s]) for s in seeds if s in a.epochs) or "-",
        ]
        for s in splits:
            v = np.array(list(a.accuracy.get(s, {}).values()))
            cells.append(
                f"{v.mean():.2%} ± {v.std(ddof=1) if len(v) > 1 else 0:.2%}" if len(v) else "-"
            )
        rows.append(cells)
    tax = bottom.subplots()
    tax.axis("off")
    table = tax.table(cellText=rows, colLabels=header, loc="center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.auto_set_column_width(list(range(len(header))))
    table.scale(1.0, 1.5)
    fig.suptitle(wrap(title, fig, 11), fontsize=11)
    if note:
        footer(fig, note)
    return fig
