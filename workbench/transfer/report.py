"""The transfer section of a study report, computed from the cells' saved test predictions.

``build_section`` is pure: it takes the test predictions of every (regime, seed) cell (as
logged) and returns DataFrames and Markdown. ``tracking.transfer.transfer_section`` feeds it
from MLflow runs. Every interval is a percentile bootstrap over the test images
(``workbench.stats``); regime differences are paired on the same resampled images, per seed
and pooled over seeds (hierarchical bootstrap, plus a t-interval over seeds).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from workbench.stats import paired_bootstrap_difference, paired_hierarchical_bootstrap, paired_seed_comparison
from workbench.transfer.evaluate import metric_cis, metrics_agree, table_metrics

METRIC_LABELS = {"qwk": "QWK", "accuracy": "accuracy", "macro_f1": "macro-F1"}


@dataclass
class CellPredictions:
    """One cell's test predictions and what was logged when it was evaluated.

    Attributes:
        regime: Regime name.
        seed: Training seed (the pairing key).
        table: The saved test predictions (``index, label, predicted, loss, prob_*``).
        logged: Test metrics logged at evaluation time (``qwk``, ``accuracy``, ...).
        best_epoch: Epoch selected on validation.
        val_qwk: Validation QWK of that epoch.
        run_id: The cell's MLflow run.
        seconds: Wall time of the cell's training and selection.
    """

    regime: str
    seed: int
    table: pd.DataFrame
    logged: dict[str, float] = field(default_factory=dict)
    best_epoch: int = 0
    val_qwk: float = float("nan")
    run_id: str = ""
    seconds: float = float("nan")


@dataclass
class TransferSection:
    """Tables and Markdown of a transfer study (see ``build_section``)."""

    kappa_table: pd.DataFrame
    summary: pd.DataFrame
    comparisons: pd.DataFrame
    markdown: str
    source: dict[str, str] = field(default_factory=dict)


def _check_same_examples(cells: list[CellPredictions]) -> tuple[np.ndarray, np.ndarray]:
    """Labels and indices shared by every cell (sorted by index); refuses mismatched test sets."""
    first = cells[0].table.sort_values("index")
    idx, labels = first["index"].to_numpy(), first["label"].to_numpy()
    for c in cells[1:]:
        t = c.table.sort_values("index")
        if not (np.array_equal(t["index"].to_numpy(), idx) and np.array_equal(t["label"].to_numpy(), labels)):
            raise ValueError(f"{c.regime}/seed{c.seed} was evaluated on other test images than "
                             f"{cells[0].regime}/seed{cells[0].seed}; a paired comparison needs the same images")
    return idx, labels


def _predicted(cell: CellPredictions) -> np.ndarray:
    return cell.table.sort_values("index")["predicted"].to_numpy()


def build_section(
    cells: list[CellPredictions], num_classes: int, regimes: list[str], reference: str,
    n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0, metrics: tuple[str, ...] = ("qwk",),
    source: dict[str, str] | None = None, title: str = "Transfer study",
) -> TransferSection:
    """Kappa table with CIs, per-regime summary over seeds, paired regime comparisons, Markdown.

    Args:
        cells: Test predictions of each finished (regime, seed) cell.
        num_classes: K (class indices 0..K-1 are ordinal grades).
        regimes: Regime names in protocol order.
        reference: The reference regime (compared against first).
        n_resamples: Bootstrap resamples per interval.
        confidence: Two-sided level.
        seed: Seed of the bootstrap draws.
        metrics: Metrics whose regime differences are compared.
        source: The source's provenance (``SourceInfo.as_params()``), shown at the top.
        title: Heading of the Markdown section.
    """
    if not cells:
        raise ValueError("no finished transfer cells to report")
    _, labels = _check_same_examples(cells)
    rows = []
    for c in sorted(cells, key=lambda c: (regimes.index(c.regime) if c.regime in regimes else len(regimes), c.seed)):
        pred = _predicted(c)
        recomputed = table_metrics(c.table, num_classes)
        cis = metric_cis(labels, pred, num_classes, n_resamples, confidence, seed)
        logged = {k: v for k, v in c.logged.items() if k in recomputed}
        agree = metrics_agree(logged, {k: recomputed[k] for k in logged})[0] if logged else False
        row = {"regime": c.regime, "seed": c.seed, "n": int(recomputed["n"])}
        for name, ci in cis.items():
            row.update({name: ci.estimate, f"{name}_low": ci.low, f"{name}_high": ci.high})
        row.update({"best_epoch": c.best_epoch, "val_qwk": c.val_qwk, "logged_test_qwk": c.logged.get("qwk", math.nan),
                    "logged_equals_file": agree, "selection_seconds": c.seconds, "run_id": c.run_id})
        rows.append(row)
    kappa = pd.DataFrame(rows)

    summary = (kappa.groupby("regime", sort=False)
               .agg(seeds=("seed", "count"), qwk_mean=("qwk", "mean"), qwk_sd=("qwk", "std"),
                    qwk_min=("qwk", "min"), qwk_max=("qwk", "max"), accuracy_mean=("accuracy", "mean"),
                    macro_f1_mean=("macro_f1", "mean"), selection_seconds_mean=("selection_seconds", "mean"))
               .reset_index())

    by = {(c.regime, c.seed): c for c in cells}
    present = [r for r in regimes if any(c.regime == r for c in cells)]
    # Each regime against the reference, then later regimes against earlier ones (protocol order).
    pairs = [(r, reference) for r in present if r != reference] + [
        (b, a) for a, b in itertools.combinations([r for r in present if r != reference], 2)]
    comps = []
    for (a, b), metric in itertools.product(pairs, metrics):
        seeds = sorted(s for (r, s) in by if r == a and (b, s) in by)
        for s in seeds:
            ci = paired_bootstrap_difference(labels, _predicted(by[a, s]), _predicted(by[b, s]), metric,
                                             n_resamples, confidence, seed, num_classes)
            comps.append({"a": a, "b": b, "metric": metric, "seed": str(s), "difference": ci.estimate,
                          "low": ci.low, "high": ci.high, "wins": "", "method": ci.method})
        if len(seeds) >= 2:
            per_a = {s: (labels, _predicted(by[a, s])) for s in seeds}
            per_b = {s: (labels, _predicted(by[b, s])) for s in seeds}
            ci = paired_hierarchical_bootstrap(per_a, per_b, metric, n_resamples, confidence, seed, num_classes)
            value = {(r, s): kappa.loc[(kappa.regime == r) & (kappa.seed == s), metric].item() for r in (a, b) for s in seeds}
            t = paired_seed_comparison({s: value[a, s] for s in seeds}, {s: value[b, s] for s in seeds},
                                       confidence, names=(a, b))
            comps.append({"a": a, "b": b, "metric": metric, "seed": "all", "difference": ci.estimate, "low": ci.low,
                          "high": ci.high, "wins": t.won, "method": ci.method})
    comparisons = pd.DataFrame(comps, columns=["a", "b", "metric", "seed", "difference", "low", "high", "wins", "method"])
    markdown = render_markdown(kappa, summary, comparisons, num_classes, n_resamples, confidence, source or {}, title)
    return TransferSection(kappa, summary, comparisons, markdown, dict(source or {}))


def _ci(row, name: str) -> str:
    return f"{row[name]:.3f} [{row[f'{name}_low']:.3f}, {row[f'{name}_high']:.3f}]"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (pipes in cells escaped)."""
    esc = [[str(v).replace("|", "\\|") for v in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in esc])


def render_markdown(kappa: pd.DataFrame, summary: pd.DataFrame, comparisons: pd.DataFrame, num_classes: int,
                    n_resamples: int, confidence: float, source: dict[str, str], title: str) -> str:
    level = f"{confidence:.0%}"
    n = int(kappa["n"].iloc[0])
    out = [f"## {title}", ""]
    if source:
        out += [f"Source: {source.get('source.label', '?')}. Kind {source.get('source.kind', '?')}, "
                f"weights `{source.get('source.uri', '?')}`"
                + (f" (run {source['source.run_id']})" if source.get("source.run_id") else "")
                + f", sha256 `{source.get('source.sha256') or 'none (random init)'}`, "
                f"pretrained: {'yes' if source.get('source.pretrained') == 'True' else 'NO'}. "
                f"Inputs normalised with {source.get('source.norm_from', '?')}.", ""]
    out += [f"Test set: {n} images, evaluated once per cell after selection on validation QWK. "
            f"Intervals: {level} percentile bootstrap over test images, {n_resamples} resamples. "
            "'file' says whether the metrics logged at evaluation equal those recomputed from the saved "
            "test predictions file.", ""]
    out.append(md_table(
        ["regime", "seed", "QWK", "accuracy", "macro-F1", "best epoch", "val QWK", "file"],
        [[r["regime"], str(int(r["seed"])), _ci(r, "qwk"), _ci(r, "accuracy"), _ci(r, "macro_f1"), str(int(r["best_epoch"])),
          f"{r['val_qwk']:.3f}", "agree" if r["logged_equals_file"] else "DIFFER"] for _, r in kappa.iterrows()]))
    out += ["", f"Per-class recall ({level} CI):", ""]
    out.append(md_table(["regime", "seed"] + [f"class {k}" for k in range(num_classes)],
                        [[r["regime"], str(int(r["seed"]))] + [_ci(r, f"recall_{k}") if not math.isnan(r[f"recall_{k}"]) else "n/a"
                          for k in range(num_classes)] for _, r in kappa.iterrows()]))
    out += ["", "Over seeds:", ""]
    out.append(md_table(["regime", "seeds", "mean QWK", "sd", "min", "max", "training + selection (s, mean)"],
                        [[r["regime"], str(r["seeds"]), f"{r['qwk_mean']:.3f}",
                          "n/a" if math.isnan(r["qwk_sd"]) else f"{r['qwk_sd']:.3f}", f"{r['qwk_min']:.3f}",
                          f"{r['qwk_max']:.3f}", "n/a" if math.isnan(r["selection_seconds_mean"])
                          else f"{r['selection_seconds_mean']:.1f}"] for _, r in summary.iterrows()]))
    if len(comparisons):
        out += ["", f"Paired regime differences (a - b on the same test images, {level} CI; seed 'all' = mean over "
                "seeds, hierarchical bootstrap over seeds and images):", ""]
        out.append(md_table(["a - b", "metric", "seed", "difference", "a better in"],
                            [[f"{r['a']} - {r['b']}", METRIC_LABELS.get(r["metric"], r["metric"]), r["seed"],
                              f"{r['difference']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]", r["wins"] or "-"]
                             for _, r in comparisons.iterrows()]))
    return "\n".join(out) + "\n"
