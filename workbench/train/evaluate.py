"""Predictions tables, metrics recomputed from them, and the checkpoint reload proof."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

# float32 round-trips exactly through 9 significant decimal digits
FLOAT_FORMAT = "%.9g"


@torch.no_grad()
def predict(
    model: nn.Module, loader, device: torch.device, amp_dtype: torch.dtype | None = None
) -> pd.DataFrame:
    """Run ``model`` over an evaluation loader and tabulate every prediction.

    Returns:
        One row per example: ``index`` (position in the dataset's source split), ``label``,
        ``predicted``, ``loss`` (per-example cross-entropy) and ``prob_0 .. prob_{K-1}``.
    """
    was_training = model.training
    model.eval()
    parts = []
    for images, labels, indices in loader:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images.to(device))
        logits = logits.float()
        labels = labels.to(device)
        probs = logits.softmax(dim=-1)
        losses = F.cross_entropy(logits, labels, reduction="none")
        parts.append(
            (indices.cpu(), labels.cpu(), probs.argmax(-1).cpu(), losses.cpu(), probs.cpu())
        )
    model.train(was_training)
    indices, labels, predicted, losses, probs = (torch.cat(p).numpy() for p in zip(*parts))
    table = pd.DataFrame(
        {"index": indices, "label": labels, "predicted": predicted, "loss": losses}
    )
    prob_cols = pd.DataFrame(probs, columns=[f"prob_{k}" for k in range(probs.shape[1])])
    return pd.concat([table, prob_cols], axis=1)


def metrics_from_predictions(table: pd.DataFrame) -> dict[str, float]:
    """Loss and accuracy, computed from the predictions table alone."""
    return {
        "loss": float(table["loss"].astype(np.float64).mean()),
        "accuracy": float((table["label"] == table["predicted"]).mean()),
    }


def save_predictions(table: pd.DataFrame, path: Path) -> Path:
    from workbench.convert.checkpoints import atomic_write_bytes

    atomic_write_bytes(Path(path), table.to_csv(index=False, float_format=FLOAT_FORMAT).encode())
    return Path(path)


def read_predictions(path: Path) -> pd.DataFrame:
    table = pd.read_csv(path)
    floats = [c for c in table.columns if c.startswith("prob_") or c == "loss"]
    table[floats] = table[floats].astype(np.float32)
    return table


@dataclass(frozen=True)
class ReloadProof:
    """Outcome of reloading a checkpoint and re-predicting its saved predictions."""

    passed: bool
    predictions_equal: bool
    max_abs_prob_diff: float
    tolerance: float
    examples: int

    def summary(self) -> str:
        verdict = "reproduced" if self.passed else "NOT reproduced"
        return (
            f"reload proof: {verdict} {self.examples} saved predictions "
            f"(max |prob difference| {self.max_abs_prob_diff:.3g}, tolerance {self.tolerance:g}, "
            f"predicted classes {'identical' if self.predictions_equal else 'differ'})"
        )


def compare_predictions(saved: pd.DataFrame, fresh: pd.DataFrame, tolerance: float) -> ReloadProof:
    saved = saved.sort_values("index").reset_index(drop=True)
    fresh = fresh.sort_values("index").reset_index(drop=True)
    if len(saved) != len(fresh) or not (saved["index"].values == fresh["index"].values).all():
        return ReloadProof(False, False, float("inf"), tolerance, len(fresh))
    probs = [c for c in saved.columns if c.startswith("prob_")]
    diff = np.abs(
        saved[probs].to_numpy(np.float64) - fresh[probs].to_numpy(np.float32).astype(np.float64)
    )
    max_diff = float(diff.max()) if diff.size else 0.0
    same = bool((saved["predicted"].values == fresh["predicted"].values).all())
    return ReloadProof(same and max_diff <= tolerance, same, max_diff, tolerance, len(fresh))
