"""The equivalence check's figure: the largest difference at every stage, on a log scale."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from workbench.equivalence import EquivalenceReport


def plot_stage_differences(report: EquivalenceReport) -> Figure:
    """Max |difference| per stage on a log scale; zeros drawn at the axis floor."""
    table = report.stage_table()
    fig = Figure(figsize=(max(8, len(table) * 0.09), 3.6))
    ax = fig.subplots()
    floor = 1e-12
    values = [max(v, floor) if not math.isnan(v) else floor for v in table["max_abs_diff"]]
    colors = ["tab:green" if p else "tab:red" for p in table["passed"]]
    ax.bar(table["index"], values, color=colors, width=0.8)
    for name, rows in report.fused.items():
        idx = [r.index for r in rows]
        ax.plot(
            idx,
            [max(r.max_abs_diff, floor) for r in rows],
            ".",
            ms=3,
            label=f"{name} (reported, not asserted)",
        )
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 1e-2)
    ax.set_xlabel("stage index")
    ax.set_ylabel("max |difference| (0 shown at floor)")
    ax.set_title(
        f"{report.architecture}: glass-box vs timm (unfused), {report.stages_passed}/{len(table)} stages exact"
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
