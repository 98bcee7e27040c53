"""The numbers of a transfer study's report, computed from the cells' saved test predictions.

``build_section`` is pure: it takes the test predictions of every (regime, seed) cell (as
logged) and returns DataFrames and confusion matrices; it renders nothing (``reports.transfer``
turns a section into Markdown and HTML). ``tracking.kinds.transfer_runs.transfer_section`` feeds it
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

from workbench.stats import (
    CI,
    PairedComparison,
    classification_metrics,
    paired_bootstrap_difference,
    paired_hierarchical_bootstrap,
    paired_seed_comparison,
)
from workbench.transfer.evaluate import metric_cis, metrics_agree, table_metrics


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
    """What a transfer report shows (see ``build_section``).

    Attributes:
        kappa_table: One row per (regime, seed): QWK, accuracy, macro-F1 and per-class recall
            with bootstrap CIs, selection facts, whether logged metrics equal the file's.
        summary: One row per regime: QWK over seeds (mean, sd, min, max) and mean times.
        comparisons: Paired regime differences per seed and over seeds (``seed == "all"``).
        confusion: Regime -> ``(K, K)`` test counts summed over its seeds (rows = true class).
        num_classes: K.
        n_resamples: Bootstrap resamples of every interval.
        confidence: Two-sided level of every interval.
        source: The source's provenance (``SourceInfo.as_params()``).
        title: The section's heading.
        paired: ``(a, b, metric)`` -> the between-seed comparison over seeds (a t-interval, paired
            t and Wilcoxon p) and the hierarchical bootstrap of the same difference, for every
            pair with at least two shared seeds; the report shows both (never only one).
    """

    kappa_table: pd.DataFrame
    summary: pd.DataFrame
    comparisons: pd.DataFrame
    confusion: dict[str, np.ndarray] = field(default_factory=dict)
    num_classes: int = 0
    n_resamples: int = 0
    confidence: float = 0.95
    source: dict[str, str] = field(default_factory=dict)
    title: str = "Transfer study"
    paired: dict[tuple[str, str, str], tuple[PairedComparison, CI]] = field(default_factory=dict)
    # "regime/seedN" -> (labels, predicted)
    predictions: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def n_test(self) -> int:
        """Test images every cell was evaluated on."""
        return int(self.kappa_table["n"].iloc[0]) if len(self.kappa_table) else 0


def _check_same_examples(cells: list[CellPredictions]) -> tuple[np.ndarray, np.ndarray]:
    """Labels and indices shared by every cell (sorted by index); refuses mismatched test sets."""
    first = cells[0].table.sort_values("index")
    idx, labels = first["index"].to_numpy(), first["label"].to_numpy()
    for c in cells[1:]:
        t = c.table.sort_values("index")
        if not (
            np.array_equal(t["index"].to_numpy(), idx)
            and np.array_equal(t["label"].to_numpy(), labels)
        ):
            raise ValueError(
                f"{c.regime}/seed{c.seed} was evaluated on other test images than "
                f"{cells[0].regime}/seed{cells[0].seed}; a paired comparison needs the same images"
            )
    return idx, labels


def _predicted(cell: CellPredictions) -> np.ndarray:
    return cell.table.sort_values("index")["predicted"].to_numpy()


COMPARISON_COLUMNS = [
    "a",
    "b",
    "metric",
    "seed",
    "difference",
    "low",
    "high",
    "wins",
    "method",
    "mc_error",
    "t_low",
    "t_high",
]


@dataclass(frozen=True)
class _Bootstrap:
    """The bootstrap's settings, shared by every interval of a section."""

    n_resamples: int
    confidence: float
    seed: int
    num_classes: int


def _kappa_row(cell: CellPredictions, labels: np.ndarray, boot: _Bootstrap) -> dict:
    """One cell's test metrics with intervals, recomputed from its file, and what its run logged."""
    pred = _predicted(cell)
    recomputed = table_metrics(cell.table, boot.num_classes)
    cis = metric_cis(labels, pred, boot.num_classes, boot.n_resamples, boot.confidence, boot.seed)
    logged = {k: v for k, v in cell.logged.items() if k in recomputed}
    agree = metrics_agree(logged, {k: recomputed[k] for k in logged})[0] if logged else False
    row = {"regime": cell.regime, "seed": cell.seed, "n": int(recomputed["n"])}
    for name, ci in cis.items():
        # Monte-Carlo SE of the endpoints
        row.update(
            {
                name: ci.estimate,
                f"{name}_low": ci.low,
                f"{name}_high": ci.high,
                f"{name}_mc": max(ci.mc_error_low, ci.mc_error_high),
            }
        )
    row.update(
        {
            "best_epoch": cell.best_epoch,
            "val_qwk": cell.val_qwk,
            "logged_test_qwk": cell.logged.get("qwk", math.nan),
            "logged_equals_file": agree,
            "selection_seconds": cell.seconds,
            "run_id": cell.run_id,
        }
    )
    return row


def _regime_summary(kappa: pd.DataFrame) -> pd.DataFrame:
    return (
        kappa.groupby("regime", sort=False)
        .agg(
            seeds=("seed", "count"),
            qwk_mean=("qwk", "mean"),
            qwk_sd=("qwk", "std"),
            qwk_min=("qwk", "min"),
            qwk_max=("qwk", "max"),
            accuracy_mean=("accuracy", "mean"),
            macro_f1_mean=("macro_f1", "mean"),
            selection_seconds_mean=("selection_seconds", "mean"),
        )
        .reset_index()
    )


def _regime_pairs(present: list[str], reference: str) -> list[tuple[str, str]]:
    """Each regime against the reference, then later regimes against earlier ones (protocol order)."""
    others = [r for r in present if r != reference]
    return [(r, reference) for r in others] + [(b, a) for a, b in itertools.combinations(others, 2)]


def _comparison_row(a: str, b: str, metric: str, seed: str, ci, **extra) -> dict:
    row = {
        "a": a,
        "b": b,
        "metric": metric,
        "seed": seed,
        "difference": ci.estimate,
        "low": ci.low,
        "high": ci.high,
        "wins": "",
        "method": ci.method,
        "mc_error": max(ci.mc_error_low, ci.mc_error_high),
        "t_low": math.nan,
        "t_high": math.nan,
    }
    return row | extra


def _compare_pair(
    a: str, b: str, metric: str, by: dict, labels: np.ndarray, kappa: pd.DataFrame, boot: _Bootstrap
) -> tuple[list[dict], tuple | None]:
    """Regime a minus b on one metric: per seed, then over the paired seeds (hierarchical
    bootstrap and the seed-paired t interval) when there are at least two."""
    seeds = sorted(s for (r, s) in by if r == a and (b, s) in by)
    settings = (boot.n_resamples, boot.confidence, boot.seed, boot.num_classes)
    rows = [
        _comparison_row(
            a,
            b,
            metric,
            str(s),
            paired_bootstrap_difference(
                labels, _predicted(by[a, s]), _predicted(by[b, s]), metric, *settings
            ),
        )
        for s in seeds
    ]
    if len(seeds) < 2:
        return rows, None
    per_a = {s: (labels, _predicted(by[a, s])) for s in seeds}
    per_b = {s: (labels, _predicted(by[b, s])) for s in seeds}
    ci = paired_hierarchical_bootstrap(per_a, per_b, metric, *settings)
    value = {
        (r, s): kappa.loc[(kappa.regime == r) & (kappa.seed == s), metric].item()
        for r in (a, b)
        for s in seeds
    }
    t = paired_seed_comparison(
        {s: value[a, s] for s in seeds},
        {s: value[b, s] for s in seeds},
        boot.confidence,
        names=(a, b),
    )
    rows.append(
        _comparison_row(a, b, metric, "all", ci, wins=t.won, t_low=t.ci_low, t_high=t.ci_high)
    )
    return rows, (t, ci)


def build_section(
    cells: list[CellPredictions],
    num_classes: int,
    regimes: list[str],
    reference: str,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
    metrics: tuple[str, ...] = ("qwk",),
    source: dict[str, str] | None = None,
    title: str = "Transfer study",
) -> TransferSection:
    """Kappa table with CIs, per-regime summary over seeds, paired regime comparisons, confusion counts.

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
        title: Heading of the section.
    """
    if not cells:
        raise ValueError("no finished transfer cells to report")
    _, labels = _check_same_examples(cells)
    boot = _Bootstrap(n_resamples, confidence, seed, num_classes)
    ordered = sorted(
        cells,
        key=lambda c: (regimes.index(c.regime) if c.regime in regimes else len(regimes), c.seed),
    )
    kappa = pd.DataFrame([_kappa_row(c, labels, boot) for c in ordered])
    by = {(c.regime, c.seed): c for c in cells}
    present = [r for r in regimes if any(c.regime == r for c in cells)]
    comps, paired = [], {}
    for (a, b), metric in itertools.product(_regime_pairs(present, reference), metrics):
        rows, pooled = _compare_pair(a, b, metric, by, labels, kappa, boot)
        comps += rows
        if pooled is not None:
            paired[(a, b, metric)] = pooled
    confusion = {}
    for c in cells:
        counts = classification_metrics(labels, _predicted(c), num_classes)["confusion_matrix"]
        confusion[c.regime] = confusion.get(c.regime, 0) + counts
    predictions = {f"{c.regime}/seed{c.seed}": (labels, _predicted(c)) for c in ordered}
    return TransferSection(
        kappa,
        _regime_summary(kappa),
        pd.DataFrame(comps, columns=COMPARISON_COLUMNS),
        {r: confusion[r] for r in present},
        num_classes,
        n_resamples,
        confidence,
        dict(source or {}),
        title,
        paired,
        predictions,
    )
