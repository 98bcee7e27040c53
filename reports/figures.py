"""Report figures as PNG bytes: training curves, paired seed values, confusion matrices.

Curves and confusion matrices are the library's (``workbench.analysis.result_figures``),
the same figures ``workbench figures`` draws; only the paired-seeds plot is the report's own.
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

from reports.collect import CURVE_METRICS, StudyData
from reports.tables import PerClass
from workbench.analysis import result_figures

DPI = 100
STYLE = {
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.hashsalt": "report",
}


def report_png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def curves(study: StudyData) -> bytes:
    """Per-epoch curves per arm (the library's one curves figure: mean over seeds, min-max band)."""
    histories = {
        arm: {seed: cell.curves for (a, seed), cell in sorted(study.cells.items()) if a == arm}
        for arm in study.spec.arms
    }
    histories = {arm: seeds for arm, seeds in histories.items() if seeds}
    return report_png(
        result_figures.curves_figure(
            histories, CURVE_METRICS, f"{study.spec.name}@{study.spec.short_hash}: training curves"
        )
    )


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
            ax.plot(
                xs, ys, color=seed_colors(i % 10), marker="o", lw=1, alpha=0.8, label=f"seed {seed}"
            )
        for j, arm in enumerate(arms):
            vals = list(values.get(arm, {}).values())
            if vals:
                ax.hlines(100 * np.mean(vals), j - 0.25, j + 0.25, color="black", lw=2)
        ax.set_xticks(
            range(len(arms)),
            [f"{a}\n(reference)" if a == study.spec.reference else a for a in arms],
        )
        ax.set_xlim(-0.5, len(arms) - 0.5)
        ax.set_ylabel(f"{'validation' if split == 'val' else 'test'} accuracy (%)")
        ax.set_title("per seed (lines join a seed's arms; bar = mean)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        return report_png(fig)


def confusion(per_class: list[PerClass], class_names: list[str], split: str) -> bytes:
    """Confusion matrix per arm, counts summed over seeds (the library's one confusion figure)."""
    matrices = {
        f"{pc.arm} ({split}, {len(pc.seeds)} seeds summed)": pc.confusion for pc in per_class
    }
    return report_png(
        result_figures.confusion_figure(matrices, class_names, f"{split} confusion matrices")
    )
