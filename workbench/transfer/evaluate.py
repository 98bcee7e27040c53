"""Metrics of a transfer cell: validation selection metrics, test metrics with bootstrap CIs.

Every number here is computed from a predictions table (``index, label, predicted, loss,
prob_*``), the same table that is saved and logged, so anyone can recompute it from the
file; ``metrics_agree`` compares the two computations.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from workbench.stats import CI, bootstrap_ci, classification_metrics

# Metrics with a bootstrap interval on the test set; recall_k are added per class.
CI_METRICS = ("qwk", "accuracy", "macro_f1")


def val_metrics(table: pd.DataFrame, num_classes: int) -> dict[str, float]:
    """An epoch's validation metrics; ``val_qwk`` selects the epoch (higher is better)."""
    y, p = table["label"].to_numpy(), table["predicted"].to_numpy()
    m = classification_metrics(y, p, num_classes)
    return {
        "val_loss": float(table["loss"].astype(np.float64).mean()),
        "val_accuracy": m["accuracy"],
        "val_qwk": m["qwk"],
        "val_macro_f1": m["macro_f1"],
    }


def table_metrics(table: pd.DataFrame, num_classes: int) -> dict[str, float]:
    """QWK, accuracy, macro F1, per-class recall (``recall_k``), mean loss and n of a predictions table."""
    y, p = table["label"].to_numpy(), table["predicted"].to_numpy()
    m = classification_metrics(y, p, num_classes)
    out = {"qwk": m["qwk"], "accuracy": m["accuracy"], "macro_f1": m["macro_f1"]}
    out.update({f"recall_{k}": r for k, r in enumerate(m["per_class_recall"])})
    out["loss"] = float(table["loss"].astype(np.float64).mean())
    out["n"] = float(m["n"])
    return out


def _recall_of(k: int):
    def recall(labels: np.ndarray, predicted: np.ndarray) -> float:
        mask = labels == k
        return float((predicted[mask] == k).mean()) if mask.any() else float("nan")

    return recall


def metric_cis(
    labels,
    predicted,
    num_classes: int,
    n_resamples: int,
    confidence: float,
    seed: int,
    metrics: tuple[str, ...] | None = None,
) -> dict[str, CI]:
    """Percentile bootstrap CIs over test examples for QWK, accuracy, macro F1 and each class's recall.

    Each metric uses the same ``seed``, hence the same resampled index sets.

    Args:
        labels, predicted: Class indices, shape (N,).
        num_classes: K.
        n_resamples, confidence, seed: As in ``workbench.stats.bootstrap_ci``.
        metrics: A subset of ``qwk, accuracy, macro_f1, recall_0 .. recall_{K-1}``; default all.
    """
    y, p = np.asarray(labels, dtype=np.int64), np.asarray(predicted, dtype=np.int64)
    names = metrics or CI_METRICS + tuple(f"recall_{k}" for k in range(num_classes))
    out = {}
    for name in names:
        metric = _recall_of(int(name.split("_")[1])) if name.startswith("recall_") else name
        out[name] = bootstrap_ci(y, p, metric, n_resamples, confidence, seed, num_classes)
    return out


def metrics_agree(
    a: dict[str, float], b: dict[str, float], tolerance: float = 0.0
) -> tuple[bool, float]:
    """Whether two metric dicts hold the same keys and values (nan equals nan); (verdict, max |diff|)."""
    if set(a) != set(b):
        return False, math.inf
    worst = 0.0
    for key in a:
        x, y = float(a[key]), float(b[key])
        if math.isnan(x) and math.isnan(y):
            continue
        worst = max(worst, abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf)
    return worst <= tolerance, worst
