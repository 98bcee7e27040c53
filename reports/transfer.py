"""The transfer report: a ``TransferSection`` rendered as blocks, like the ablation report.

The numbers come from ``workbench.transfer.report.build_section`` (through
``tracking.transfer.transfer_section``, which reads the cells' saved test predictions);
this module only lays them out as ``reports.render`` blocks, so the Markdown and the HTML
hold the same numbers, and adds the library's confusion-matrix and training-curve figures.
"""

from __future__ import annotations

import math

import pandas as pd

from reports.render import Block, Bullets, Figure, Heading, Para, Table, to_markdown
from workbench.transfer.report import TransferSection

METRIC_LABELS = {"qwk": "QWK", "accuracy": "accuracy", "macro_f1": "macro-F1"}
# Per-epoch metrics a transfer cell logs (tracking.transfer.TRANSFER_EPOCH_METRICS), one panel each.
CURVE_METRICS = ("val_qwk", "val_loss", "train_loss", "val_accuracy")


def _ci(row, name: str) -> str:
    return f"{row[name]:.3f} [{row[f'{name}_low']:.3f}, {row[f'{name}_high']:.3f}]"


def _num(value: float, fmt: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


def source_text(source: dict[str, str]) -> str:
    """One sentence naming the source checkpoint and its provenance."""
    run = f" (run `{source['source.run_id']}`)" if source.get("source.run_id") else ""
    return (f"Source: {source.get('source.label', '?')}. Kind {source.get('source.kind', '?')}, weights "
            f"`{source.get('source.uri', '?')}`{run}, sha256 `{source.get('source.sha256') or 'none (random init)'}`, "
            f"pretrained: {'yes' if source.get('source.pretrained') == 'True' else '**NO**'}. "
            f"Inputs normalised with {source.get('source.norm_from', '?')}.")


def section_blocks(section: TransferSection, level: int = 2) -> list[Block]:
    """The section's tables (no figures, no MLflow): what the study prints and logs at its end."""
    kappa, summary, comps, k = section.kappa_table, section.summary, section.comparisons, section.num_classes
    ci = f"{section.confidence:.0%}"
    h = level
    blocks: list[Block] = [Heading(h, section.title)]
    if section.source:
        blocks.append(Para(source_text(section.source)))
    blocks.append(Para(
        f"Test set: {section.n_test} images, evaluated once per cell after selection on validation QWK. "
        f"Intervals: {ci} percentile bootstrap over test images, {section.n_resamples} resamples."))
    blocks += [Heading(h + 1, "Test metrics per cell"), Table(
        ["regime", "seed", "QWK", "accuracy", "macro-F1", "best epoch", "val QWK", "file"],
        [[r["regime"], str(int(r["seed"])), _ci(r, "qwk"), _ci(r, "accuracy"), _ci(r, "macro_f1"),
          str(int(r["best_epoch"])), _num(r["val_qwk"], ".3f"), "agree" if r["logged_equals_file"] else "DIFFER"]
         for _, r in kappa.iterrows()],
        ["l", "r", "r", "r", "r", "r", "r", "l"],
        [f"Estimate [{ci} CI]. 'file': whether the metrics logged at evaluation equal those recomputed from the "
         "saved predictions/test.csv of the run."])]
    blocks += [Heading(h + 1, "Per-class recall"), Table(
        ["regime", "seed"] + [f"class {j}" for j in range(k)],
        [[r["regime"], str(int(r["seed"]))] + [_ci(r, f"recall_{j}") if math.isfinite(r[f"recall_{j}"]) else "n/a"
                                               for j in range(k)] for _, r in kappa.iterrows()],
        ["l", "r"] + ["r"] * k, [f"Recall of each true class on the test set [{ci} CI]."], css_class="wide")]
    blocks += [Heading(h + 1, "Over seeds"), Table(
        ["regime", "seeds", "mean QWK", "sd", "min", "max", "training + selection (s, mean)"],
        [[r["regime"], str(r["seeds"]), _num(r["qwk_mean"], ".3f"), _num(r["qwk_sd"], ".3f"), _num(r["qwk_min"], ".3f"),
          _num(r["qwk_max"], ".3f"), _num(r["selection_seconds_mean"], ".1f")] for _, r in summary.iterrows()],
        ["l", "r", "r", "r", "r", "r", "r"], ["sd: sample standard deviation over seeds (n/a for one seed)."])]
    if len(comps):
        blocks += [Heading(h + 1, "Paired regime differences"), Table(
            ["a − b", "metric", "seed", "difference", "a better in"],
            [[f"{r['a']} − {r['b']}", METRIC_LABELS.get(r["metric"], r["metric"]), r["seed"],
              f"{r['difference']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]", r["wins"] or "-"]
             for _, r in comps.iterrows()],
            ["l", "l", "r", "r", "r"],
            [f"a − b on the same test images [{ci} CI]; seed 'all' = mean over seeds, hierarchical bootstrap over "
             "seeds and images; 'a better in': seeds where a's value is higher."])]
    return blocks


def transfer_markdown(section: TransferSection) -> str:
    """The section as Markdown (printed and logged by ``workbench transfer`` at the end of a run)."""
    return to_markdown(section_blocks(section))


def figure_blocks(section: TransferSection, histories: dict[str, dict[int, dict[str, dict[int, float]]]],
                  png) -> list[Block]:
    """Confusion matrices and training curves, drawn by the library's one implementation of each.

    Args:
        histories: ``regime -> seed -> metric -> epoch -> value`` of the reported runs.
        png: Figure -> PNG bytes (``reports.figures._png``: deterministic bytes).
    """
    from workbench.analysis import result_figures as rf

    blocks: list[Block] = []
    if section.confusion:
        seeds = section.kappa_table.groupby("regime", sort=False)["seed"].count().to_dict()
        matrices = {f"{r} (test, {seeds.get(r, 0)} seeds summed)": m for r, m in section.confusion.items()}
        names = [str(j) for j in range(section.num_classes)]
        blocks += [Heading(2, "Confusion matrices"), Figure(
            "confusion_test.png", "Test confusion matrices: counts summed over each regime's seeds, colour = share of "
            "the true class (row).", png(rf.confusion_figure(matrices, names, "test confusion matrices")))]
    histories = {r: seeds for r, seeds in histories.items() if any(any(m.values()) for m in seeds.values())}
    if histories:
        blocks += [Heading(2, "Training curves"), Figure(
            "curves.png", "Per-epoch metrics logged by each run (MLflow metric history, step = epoch): mean over the "
            "regime's seeds, band from the lowest to the highest seed.",
            png(rf.curves_figure(histories, CURVE_METRICS, f"{section.title}: training curves")))]
    return blocks


def runs_blocks(kappa: pd.DataFrame) -> list[Block]:
    return [Heading(2, "Runs"), Para("Every number above comes from these MLflow runs (one per regime and seed)."),
            Table(["regime", "seed", "run id", "training + selection (s)"],
                  [[r["regime"], str(int(r["seed"])), f"`{r['run_id']}`", _num(r["selection_seconds"], ".1f")]
                   for _, r in kappa.iterrows()], ["l", "r", "l", "r"])]
