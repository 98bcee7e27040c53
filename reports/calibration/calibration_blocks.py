"""A report's calibration section, from each cell's saved per-example probabilities (no re-training).

Per cell: the temperature fitted on validation and ECE (15 bins), NLL and Brier score before and
after scaling (``workbench.calibration``); per arm or regime: their means over seeds; and the
seed-paired differences of each compared pair (``workbench.stats.paired_seed_comparison``:
mean over seeds with its t-interval, and in how many seeds ``a`` is lower, i.e. better calibrated).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pandas as pd

from reports.collect import StudyData
from reports.render import Block, Heading, Para, Table
from workbench import stats
from workbench.calibration import BINS, METRICS, Calibration, calibrate

NAMES = {"ece": "ECE", "nll": "NLL", "brier": "Brier"}
CONFIDENCE = 0.95


def _probs(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    columns = sorted(
        (c for c in table.columns if c.startswith("prob_")), key=lambda c: int(c[len("prob_") :])
    )
    if not columns:
        return None
    ordered = table.sort_values("index", kind="stable")
    return ordered[columns].to_numpy(np.float64), ordered["label"].to_numpy(np.int64)


def cell_calibration(predictions: dict[str, pd.DataFrame]) -> Calibration | None:
    """The cell's calibration (split -> table with ``label`` and ``prob_*``), None without probabilities on validation."""
    val = _probs(predictions["val"]) if "val" in predictions else None
    if val is None:
        return None
    test = _probs(predictions["test"]) if "test" in predictions else None
    return calibrate(*val, *(test or (None, None)))


def from_csv_bytes(files: dict[str, bytes]) -> dict[str, pd.DataFrame]:
    """Logged ``predictions/<split>.csv`` files (bytes) as tables."""
    return {split: pd.read_csv(io.BytesIO(data)) for split, data in files.items()}


@dataclass(frozen=True)
class PairedCalibration:
    """a - b of one score, before or after scaling, paired by seed."""

    a: str
    b: str
    metric: str
    stage: str  # "before" or "after"
    paired: stats.PairedComparison


def paired_differences(
    cells: dict[tuple[str, int], Calibration], pairs: list[tuple[str, str]]
) -> list[PairedCalibration]:
    out = []
    for a, b in pairs:
        for stage in ("before", "after"):
            for metric in METRICS:
                va = {s: getattr(c, stage)[metric] for (u, s), c in cells.items() if u == a}
                vb = {s: getattr(c, stage)[metric] for (u, s), c in cells.items() if u == b}
                if set(va) & set(vb):
                    paired = stats.paired_seed_comparison(
                        va, vb, CONFIDENCE, allow_missing=True, names=(a, b)
                    )
                    out.append(PairedCalibration(a, b, metric, stage, paired))
    return out


def _arrow(before: float, after: float, digits: int) -> str:
    return f"{before:.{digits}f} → {after:.{digits}f}"


def _mean(cells: list[Calibration], stage: str, metric: str) -> float:
    return float(np.mean([getattr(c, stage)[metric] for c in cells]))


def _interval(p: stats.PairedComparison) -> str:
    if not np.isfinite(p.ci_low):
        return f"{p.mean_difference:+.4f} (n={p.n}; no interval)"
    return f"{p.mean_difference:+.4f} [{p.ci_low:+.4f}, {p.ci_high:+.4f}]"


def calibration_blocks(
    cells: dict[tuple[str, int], Calibration],
    units: list[str],
    pairs: list[tuple[str, str]],
    *,
    unit: str = "arm",
    absent: str = "",
) -> list[Block]:
    """The section: what is computed and how, per cell, per arm, paired differences.

    Args:
        cells: (arm or regime, seed) -> its calibration; cells without probabilities left out.
        units: Arms or regimes in report order.
        pairs: (a, b) pairs to difference, a - b.
        unit: "arm" or "regime".
        absent: Why no cell has a calibration (shown instead of the tables when ``cells`` is empty).
    """
    blocks: list[Block] = [Heading(2, "Calibration")]
    method = (
        "From each cell's saved per-example probabilities, with no re-training: expected "
        f"calibration error (ECE, {BINS} equal-width confidence bins), negative log-likelihood (NLL, "
        "mean -log p of the true class) and Brier score (mean over examples of the summed squared "
        "difference to the one-hot label), before and after temperature scaling. The temperature T "
        "is one scalar fitted on validation by minimising the NLL of softmax(log p / T): the saved "
        "files hold probabilities, not logits, and scaling the log-probabilities is the same map as "
        "scaling the logits (they differ by a per-example constant). Scored on test, where a cell "
        "has it; on validation otherwise, cross-fitted (T fitted on one half of the examples, "
        "applied to the other, and the other way round). Lower is better for all three."
    )
    if not cells:
        return blocks + [Para(method), Para(absent or "No cell has saved probabilities.")]
    blocks.append(Para(method))
    rows = []
    for (u, s), c in sorted(cells.items(), key=lambda kv: (units.index(kv[0][0]), kv[0][1])):
        rows.append(
            [
                u,
                str(s),
                c.split,
                f"{c.temperature:.3f}",
                _arrow(c.before["ece"], c.after["ece"], 4),
                _arrow(c.before["nll"], c.after["nll"], 4),
                _arrow(c.before["brier"], c.after["brier"], 4),
            ]
        )
    header = [unit, "seed", "scored on", "T", "ECE before → after", "NLL", "Brier"]
    blocks.append(Table(header, rows, ["l", "r", "l", "r", "r", "r", "r"], css_class="nowrap"))
    means = []
    for u in units:
        mine = [c for (v, _), c in cells.items() if v == u]
        if not mine:
            continue
        means.append(
            [u, str(len(mine)), f"{np.mean([c.temperature for c in mine]):.3f}"]
            + [_arrow(_mean(mine, "before", m), _mean(mine, "after", m), 4) for m in METRICS]
        )
    blocks.append(
        Table(
            [unit, "seeds", "mean T", "ECE before → after", "NLL", "Brier"],
            means,
            ["l", "r", "r", "r", "r", "r"],
            ["Means over the seeds of the per-cell values above."],
        )
    )
    diffs = paired_differences(cells, pairs)
    if diffs:
        drows = [
            [
                f"{d.a} - {d.b}",
                d.stage,
                NAMES[d.metric],
                _interval(d.paired),
                f"{d.paired.losses} of {d.paired.n}",
            ]
            for d in diffs
        ]
        blocks.append(
            Table(
                ["pair", "scaling", "score", "mean difference [95% t-interval]", "a lower in"],
                drows,
                ["l", "l", "l", "r", "r"],
                [
                    "Seed-paired: per seed a - b of the score, then the mean over seeds with its "
                    "Student-t interval. Negative: a is better calibrated. 'a lower in': seeds "
                    "where a's score is below b's."
                ],
            )
        )
    return blocks


def ablation_calibration(study: StudyData, pairs: list[tuple[str, str]]) -> list[Block]:
    """The calibration section of an ablation report: every reported cell, the report's pairs."""
    cells = {}
    for key, cell in study.cells.items():
        found = cell_calibration(cell.predictions)
        if found is not None:
            cells[key] = found
    absent = (
        "Not computed: the evidence export this report was rebuilt from holds each example's "
        "predicted class only (it was exported before probabilities were). Build the report from "
        "the MLflow store, or export its evidence again (`workbench report --evidence`), to "
        "compute it."
        if study.rebuilt_from
        else "Not computed: no reported cell logged per-example probabilities."
    )
    return calibration_blocks(cells, list(study.spec.arms), pairs, unit="arm", absent=absent)


def transfer_calibration(
    cells: dict[tuple[str, int], dict[str, bytes]], regimes: list[str]
) -> list[Block]:
    """The calibration section of a transfer report: every chosen cell's logged prediction files,
    every pair of regimes (in protocol order, a - b with a listed first)."""
    found = {}
    for key, files in cells.items():
        calibration = cell_calibration(from_csv_bytes(files))
        if calibration is not None:
            found[key] = calibration
    pairs = [(a, b) for i, a in enumerate(regimes) for b in regimes[i + 1 :]]
    return calibration_blocks(found, regimes, pairs, unit="regime")
