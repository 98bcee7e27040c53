"""The benchmark's figure: each variant's time against timm fused, and its share of the matmul peak."""

from __future__ import annotations

from matplotlib.figure import Figure

from workbench.bench.run import BenchmarkResult


def plot_benchmark(result: BenchmarkResult) -> Figure:
    """Left: time / timm fused with IQR bars (goal lines at 1.05 and 1.10).
    Right: achieved GFLOP/s as a percentage of the fp32 matmul probe's, same rounds."""
    full = result.timings()
    # The reference's own ratio is 1 by construction, and a CNN has no timm counterpart.
    table = full[full["variant"].isin(["glass_written", "glass_fast", "timm_unfused"])]
    fig = Figure(figsize=(13, max(3.0, 0.22 * len(full) + 1.2)))
    left, right = fig.subplots(1, 2)
    labels = [f"{r.section[:5]} {r.model} b{r.batch} {r.variant}" for r in table.itertuples()]
    if len(table):
        ratio = table["ratio_to_timm_fused"].to_numpy()
        err = [
            ratio - table["ratio_to_timm_fused_q1"].to_numpy(),
            table["ratio_to_timm_fused_q3"].to_numpy() - ratio,
        ]
        palette = {"glass_fast": "tab:blue", "glass_written": "tab:orange"}
        colors = [palette.get(v, "tab:gray") for v in table["variant"]]
        left.barh(range(len(table)), ratio, xerr=err, color=colors, capsize=2)
        left.set_yticks(range(len(table)), labels, fontsize=7)
        for x, style in ((1.0, "-"), (1.05, "--"), (1.10, ":")):
            left.axvline(x, color="k", lw=0.8, ls=style)
        left.invert_yaxis()
    left.set_xlabel("time / timm fused (median of per-round ratios, IQR bars)")
    left.set_title("ratio to timm fused, same run")
    pct = 100 * full["fraction_of_fp32_peak"].fillna(0).to_numpy()
    right.barh(range(len(full)), pct, color="tab:green")
    right.set_yticks(range(len(full)), [f"{r.section[:5]} {r.model} b{r.batch} {r.variant}" for r in full.itertuples()],
                     fontsize=7)  # fmt: skip
    right.invert_yaxis()
    right.set_xlabel("% of fp32 matmul throughput (timed in the same rounds)")
    right.set_title(f"achieved (analytic FLOPs), {result.info['device_name']}", fontsize=9)
    fig.tight_layout()
    return fig
