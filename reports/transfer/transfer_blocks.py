"""The transfer report: a ``TransferSection`` rendered as blocks, like the ablation report.

The numbers come from ``workbench.transfer.report.build_section`` (through
``tracking.kinds.transfer_runs.transfer_section``, which reads the cells' saved test predictions);
this module only lays them out as ``reports.render`` blocks, so the Markdown and the HTML
hold the same numbers. Every regime difference over seeds shows BOTH the between-seed
t-interval and the hierarchical bootstrap, and the results paragraph lets the wider one
decide; bootstrap endpoints carry only the decimals their Monte-Carlo error supports; a
zero-width interval is never shown without the warning that explains it.
"""

from __future__ import annotations

import math

from reports.render import Block, Figure, Heading, Para, Quote, Table, to_markdown
from reports.content import comparison, forest
from workbench.estimates import (
    bootstrap_seed_multisets,
    decimals_for_error,
    mean_interval,
    min_wilcoxon_p,
)
from reports.content.predictions import DegenerateReport, degenerate_predictions
from reports.content.rounding import fmt
from reports.content.wording import section_caveats
from workbench.transfer.report import TransferSection

METRIC_LABELS = {"qwk": "QWK", "accuracy": "accuracy", "macro_f1": "macro-F1"}
# Per-epoch metrics a transfer cell logs (tracking.kinds.transfer_runs.TRANSFER_EPOCH_METRICS), one panel each.
CURVE_METRICS = ("val_qwk", "val_loss", "train_loss", "val_accuracy")
DECIMALS = 3  # QWK, accuracy and F1 in [0, 1]
FLAG = "⚠"


def _num(value: float, fmt_spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt_spec)


def _ci(row, name: str, warning: str | None = None) -> str:
    """``estimate [low, high]``: endpoints at the decimals their Monte-Carlo error supports (at most 3)."""
    est, low, high = row[name], row[f"{name}_low"], row[f"{name}_high"]
    if not math.isfinite(est):
        return "n/a"
    d = min(DECIMALS, decimals_for_error(row.get(f"{name}_mc", math.nan), DECIMALS))
    text = f"{fmt(est, DECIMALS)} [{fmt(low, d)}, {fmt(high, d)}]"
    if (
        math.isfinite(low) and math.isfinite(high) and high == low
    ):  # never shown bare: the flag says why
        return f"{text} {FLAG} {warning or 'no spread'}"
    return text


def source_provenance(source: dict[str, str]) -> str:
    """What the source weights are; runs logged before ``source.provenance`` existed say it from ``source.kind``."""
    if source.get("source.provenance"):
        return source["source.provenance"]
    if source.get("source.kind") == "timm-hub":
        return "a published pretrained checkpoint (pinned timm hub revision)"
    if source.get("source.kind") == "timm-random":
        return "a seeded random init, **NOT PRETRAINED**"
    return f"{source.get('source.kind', 'unknown')} weights, not a published checkpoint"


def source_text(source: dict[str, str]) -> str:
    """One sentence naming the source checkpoint and its provenance."""
    run = f" (run `{source['source.run_id']}`)" if source.get("source.run_id") else ""
    return (
        f"Source: {source.get('source.label', '?')}. Kind {source.get('source.kind', '?')}, weights "
        f"`{source.get('source.uri', '?')}`{run}, sha256 `{source.get('source.sha256') or 'none (random init)'}`, "
        f"weights: {source_provenance(source)}. "
        f"Inputs normalised with {source.get('source.norm_from', '?')}."
    )


def degenerate(section: TransferSection) -> DegenerateReport | None:
    if not section.predictions or not section.num_classes:
        return None
    return degenerate_predictions(
        section.predictions, section.num_classes, [f"class {j}" for j in range(section.num_classes)]
    )


def _per_cell_blocks(
    section: TransferSection, h: int, report: DegenerateReport | None
) -> list[Block]:
    kappa, k, ci = section.kappa_table, section.num_classes, f"{section.confidence:.0%}"
    blocks: list[Block] = [
        Heading(h + 1, "Test metrics per cell"),
        Table(
            ["regime", "seed", "QWK", "accuracy", "macro-F1", "best epoch", "val QWK", "file"],
            [
                [
                    r["regime"],
                    str(int(r["seed"])),
                    _ci(r, "qwk"),
                    _ci(r, "accuracy"),
                    _ci(r, "macro_f1"),
                    str(int(r["best_epoch"])),
                    _num(r["val_qwk"], ".3f"),
                    "agree" if r["logged_equals_file"] else "DIFFER",
                ]
                for _, r in kappa.iterrows()
            ],
            ["l", "r", "r", "r", "r", "r", "r", "l"],
            [
                f"Estimate [{ci} percentile bootstrap over test images, {section.n_resamples:,} resamples]; endpoints shown "
                f"to the decimals their Monte-Carlo standard error supports (at most 3); '{FLAG} no spread': a zero-width "
                "interval, every resample gives the same value, not certainty. 'file': whether the metrics logged "
                "at evaluation equal those recomputed from the saved predictions/test.csv of the run."
            ],
        ),
    ]
    rows = []
    for _, r in kappa.iterrows():
        run = f"{r['regime']}/seed{int(r['seed'])}"
        cells = []
        for j in range(k):
            never = report is not None and j in report.never_predicted.get(run, [])
            warn = "never predicted" if never else None
            cells.append(_ci(r, f"recall_{j}", warn) if math.isfinite(r[f"recall_{j}"]) else "n/a")
        rows.append([r["regime"], str(int(r["seed"]))] + cells)
    blocks += [
        Heading(h + 1, "Per-class recall"),
        Table(
            ["regime", "seed"] + [f"class {j}" for j in range(k)],
            rows,
            ["l", "r"] + ["r"] * k,
            [
                f"Recall of each true class on the test set [{ci} CI]. A zero-width interval is flagged with why: "
                f"'{FLAG} never predicted': the run never predicts the class, so its recall is 0 by construction, not "
                f"measured; '{FLAG} no spread': every bootstrap resample gives the same value (e.g. all of the class right), "
                "which is not certainty."
            ],
            css_class="wide",
        ),
    ]
    if report is not None:
        never = [
            ", ".join(f"class {c}" for c in report.never_predicted[run]) or "–"
            for run in report.counts
        ]
        blocks.append(
            Table(
                ["run", *[f"class {j}" for j in range(k)], "never predicts"],
                [
                    [run, *map(str, counts), nv]
                    for (run, counts), nv in zip(report.counts.items(), never)
                ],
                ["l", *["r"] * k, "l"],
                [
                    "How often each run predicts each class on the test set. A class a run never predicts has "
                    "recall 0 by construction, not by measurement."
                ]
                + [f"{FLAG} {w}." for w in report.warnings],
                css_class="wide",
            )
        )
    return blocks


def _over_seeds(section: TransferSection, h: int) -> list[Block]:
    rows = []
    for _, r in section.summary.iterrows():
        values = section.kappa_table.loc[section.kappa_table.regime == r["regime"], "qwk"].tolist()
        mi = mean_interval(values, section.confidence) if values else None
        t = (
            "n/a"
            if mi is None or not math.isfinite(mi.low)
            else f"[{fmt(mi.low, DECIMALS)}, {fmt(mi.high, DECIMALS)}]"
        )
        if mi is not None and mi.note and mi.n > 1:
            t += f" {FLAG} {mi.note}"
        rows.append(
            [
                r["regime"],
                str(r["seeds"]),
                _num(r["qwk_mean"], ".3f"),
                t,
                _num(r["qwk_sd"], ".3f"),
                _num(r["qwk_min"], ".3f"),
                _num(r["qwk_max"], ".3f"),
            ]
        )
    return [
        Heading(h + 1, "Over seeds"),
        Table(
            ["regime", "seeds", "mean QWK", "95% t-interval", "sd", "min", "max"],
            rows,
            ["l", "r", "r", "r", "r", "r", "r"],
            [
                "sd: sample standard deviation over seeds; t-interval: Student-t over seeds (df = n − 1); n/a for one seed."
            ],
        ),
    ]


def _differences(section: TransferSection, h: int) -> list[Block]:
    comps = section.comparisons
    if not len(comps):
        return []
    rows = []
    for _, r in comps.iterrows():
        d = min(DECIMALS, decimals_for_error(r.get("mc_error", math.nan), DECIMALS))
        boot = f"[{fmt(r['low'], d, True)}, {fmt(r['high'], d, True)}]"
        t = (
            f"[{fmt(r['t_low'], DECIMALS, True)}, {fmt(r['t_high'], DECIMALS, True)}]"
            if math.isfinite(r.get("t_low", math.nan))
            else ("–" if r["seed"] != "all" else "n/a")
        )
        rows.append(
            [
                f"{r['a']} − {r['b']}",
                METRIC_LABELS.get(r["metric"], r["metric"]),
                r["seed"],
                fmt(r["difference"], DECIMALS, True),
                t,
                boot,
                r["wins"] or "–",
            ]
        )
    n = int(section.summary["seeds"].max()) if len(section.summary) else 0
    return [
        Heading(h + 1, "Paired regime differences"),
        Table(
            [
                "a − b",
                "metric",
                "seed",
                "difference",
                "95% t-interval (seeds)",
                "95% bootstrap",
                "a better in",
            ],
            rows,
            ["l", "l", "r", "r", "r", "r", "r"],
            [
                "a − b on the same test images. Seed k: percentile bootstrap over test images of that seed's runs. Seed 'all': "
                "mean over seeds, with the Student-t interval over seeds (df = n − 1) AND the hierarchical bootstrap (seeds, "
                f"then images); from {n} seeds the bootstrap can draw only {bootstrap_seed_multisets(n)} distinct seed sets, "
                f"so its seed level is coarse. With {n} seeds the smallest attainable two-sided Wilcoxon p is "
                f"{min_wilcoxon_p(n):.3g}. Bootstrap endpoints shown to the decimals their Monte-Carlo error supports."
            ],
        ),
    ]


def section_blocks(section: TransferSection, level: int = 2) -> list[Block]:
    """The section's tables (no figures, no MLflow): what the study prints and logs at its end."""
    h = level
    blocks: list[Block] = [Heading(h, section.title)]
    if section.source:
        blocks.append(Para(source_text(section.source)))
    blocks.append(
        Para(
            f"Test set: {section.n_test} images, evaluated once per cell after selection on validation QWK. "
            f"Intervals: {section.confidence:.0%}; bootstrap over test images, {section.n_resamples:,} resamples."
        )
    )
    return (
        blocks
        + _per_cell_blocks(section, h, degenerate(section))
        + _over_seeds(section, h)
        + _differences(section, h)
    )


def results_blocks(section: TransferSection, reference: str, expected_n: int) -> list[Block]:
    """A stated result per regime pair (QWK over seeds) and a forest plot of every regime against the reference."""
    items = []
    kappa = section.kappa_table
    for (a, b, metric), (paired, boot) in section.paired.items():
        va = {
            int(s): v
            for s, v in zip(
                kappa.loc[kappa.regime == a, "seed"], kappa.loc[kappa.regime == a, metric]
            )
        }
        vb = {
            int(s): v
            for s, v in zip(
                kappa.loc[kappa.regime == b, "seed"], kappa.loc[kappa.regime == b, metric]
            )
        }
        items.append(
            (
                a,
                b,
                comparison.comparison_content(
                    paired,
                    boot,
                    va,
                    vb,
                    a_label=a,
                    b_label=b,
                    split="test",
                    expected_n=expected_n,
                    scale=1.0,
                    unit="",
                    metric=METRIC_LABELS.get(metric, metric),
                ),
            )
        )
    if not items:
        return [
            Heading(2, "Results"),
            Para("No regime pair has two or more seeds: no comparison over seeds."),
        ]
    blocks: list[Block] = [Heading(2, "Results")]
    blocks += [Quote(cc.paragraph.text.replace("  of", " of")) for _, _, cc in items]
    caveats = section_caveats(cc.paragraph for _, _, cc in items)
    blocks += [Para(caveats)] if caveats else []
    rows = [cc.forest_row for a, b, cc in items if b == reference]
    if rows:
        fig = forest.forest_plot(
            rows,
            reference,
            scale=1.0,
            unit="",
            metric="test QWK",
            title=f"Test QWK: every regime against {reference}",
        )
        blocks.append(
            Figure(
                "forest_test.png",
                (
                    f"Test QWK, every regime minus the reference {reference}, paired by seed: dot = mean difference, thick bar = "
                    "95% t-interval over seeds, thin bar = 95% hierarchical bootstrap; wins k of n = seeds where the regime is "
                    "ahead."
                ),
                forest.figure_png(fig),
            )
        )
    return blocks


def transfer_markdown(section: TransferSection) -> str:
    """The section as Markdown (printed and logged by ``workbench transfer`` at the end of a run)."""
    return to_markdown(section_blocks(section))


def figure_blocks(
    section: TransferSection, histories: dict[str, dict[int, dict[str, dict[int, float]]]], png
) -> list[Block]:
    """Confusion matrices and training curves, drawn by the library's one implementation of each.

    Args:
        histories: ``regime -> seed -> metric -> epoch -> value`` of the reported runs.
        png: Figure -> PNG bytes (``reports.figures.report_png``: deterministic bytes).
    """
    from workbench.analysis import result_figures

    blocks: list[Block] = []
    if section.confusion:
        seeds = section.kappa_table.groupby("regime", sort=False)["seed"].count().to_dict()
        matrices = {
            f"{r} (test, {seeds.get(r, 0)} seeds summed)": m for r, m in section.confusion.items()
        }
        names = [str(j) for j in range(section.num_classes)]
        blocks += [
            Heading(2, "Confusion matrices"),
            Figure(
                "confusion_test.png",
                "Test confusion matrices: counts summed over each regime's seeds, colour = share of "
                "the true class (row).",
                png(result_figures.confusion_figure(matrices, names, "test confusion matrices")),
            ),
        ]
    histories = {
        r: seeds for r, seeds in histories.items() if any(any(m.values()) for m in seeds.values())
    }
    if histories:
        blocks += [
            Heading(2, "Training curves"),
            Figure(
                "curves.png",
                "Per-epoch metrics logged by each run (MLflow metric history, step = epoch): mean over the "
                "regime's seeds, band from the lowest to the highest seed.",
                png(
                    result_figures.curves_figure(
                        histories, CURVE_METRICS, f"{section.title}: training curves"
                    )
                ),
            ),
        ]
    return blocks
