"""Calibration of saved predictions: ECE, NLL and Brier score, before and after temperature scaling.

Computed from a cell's saved per-example probabilities, with no model and no re-training:

- ECE (expected calibration error, Guo et al. 2017): the examples binned by confidence (the
  largest probability) into 15 equal-width bins ``(0, 1/15], (1/15, 2/15], ...``; the sum over
  bins of the bin's share of examples times |accuracy - mean confidence| in the bin.
- NLL: the mean of ``-log p(true class)``, the probability floored at ``PROB_FLOOR`` (a saved
  probability rounded to 0).
- Brier score: the mean over examples of the sum over classes of ``(p_k - [k = label])^2``
  (Brier 1950's multi-class form: 0 perfect, 2 worst).
- Temperature scaling (Guo et al. 2017): one scalar ``T > 0`` with the probabilities
  ``softmax(z / T)``, fitted by minimising the NLL on validation. Saved files hold probabilities,
  not logits; ``log p = z - logsumexp(z)`` differs from the logits by a per-example constant, which
  softmax ignores, so scaling the log-probabilities is the same map as scaling the logits (up to
  the rounding of the saved probabilities).

Where a cell has a test split, T is fitted on validation and every number is the test split's.
Where it has validation only, T is cross-fitted: fitted on the even-position examples and
applied to the odd ones, and the other way round, so no example is scored by a temperature
fitted on itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax

BINS = 15
PROB_FLOOR = 1e-12
LOG_T_BOUNDS = (-4.0, 4.0)  # T from 0.018 to 55: far beyond any fitted value met in practice
METRICS = ("ece", "nll", "brier")


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error over ``bins`` equal-width confidence bins (probs: (N, K))."""
    confidence = probs.max(axis=1)
    correct = probs.argmax(axis=1) == labels
    # bin b holds confidences in (b/bins, (b+1)/bins]; a confidence of exactly 0 goes to bin 0
    index = np.clip(np.ceil(confidence * bins).astype(int) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        members = index == b
        if members.any():
            gap = abs(correct[members].mean() - confidence[members].mean())
            total += members.mean() * gap
    return float(total)


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-probability of the true class (floored at ``PROB_FLOOR``)."""
    picked = probs[np.arange(len(labels)), labels]
    return float(-np.log(np.maximum(picked, PROB_FLOOR)).mean())


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean over examples of the summed squared difference to the one-hot label."""
    onehot = np.zeros_like(probs)
    onehot[np.arange(len(labels)), labels] = 1.0
    return float(((probs - onehot) ** 2).sum(axis=1).mean())


def scores(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    return {"ece": ece(probs, labels), "nll": nll(probs, labels), "brier": brier(probs, labels)}


def log_probs(probs: np.ndarray) -> np.ndarray:
    """Saved probabilities as log-probabilities (floored), in float64."""
    return np.log(np.maximum(np.asarray(probs, dtype=np.float64), PROB_FLOOR))


def scaled(logp: np.ndarray, temperature: float) -> np.ndarray:
    """``softmax(logp / T)``."""
    return np.exp(log_softmax(logp / temperature, axis=1))


def fit_temperature(logp: np.ndarray, labels: np.ndarray) -> float:
    """The ``T`` that minimises the NLL of ``softmax(logp / T)`` (searched over log T, bounded)."""
    rows = np.arange(len(labels))

    def loss(log_t: float) -> float:
        return float(-log_softmax(logp / np.exp(log_t), axis=1)[rows, labels].mean())

    found = minimize_scalar(loss, bounds=LOG_T_BOUNDS, method="bounded", options={"xatol": 1e-6})
    return float(np.exp(found.x))


@dataclass(frozen=True)
class Calibration:
    """One cell's calibration on ``split``: before and after temperature scaling."""

    split: str  # the split scored ("test", or "val" when cross-fitted)
    fitted_on: str  # "val", or "val (cross-fitted halves)"
    temperature: float  # fitted on all of validation (the cross-fitted halves' T are not shown)
    before: dict[str, float]
    after: dict[str, float]
    examples: int


def calibrate(
    val_probs: np.ndarray,
    val_labels: np.ndarray,
    test_probs: np.ndarray | None = None,
    test_labels: np.ndarray | None = None,
) -> Calibration:
    """Temperature fitted on validation, scores before and after on test (or cross-fitted on validation)."""
    val_logp = log_probs(val_probs)
    temperature = fit_temperature(val_logp, val_labels)
    if test_probs is not None and test_labels is not None:
        after = scaled(log_probs(test_probs), temperature)
        return Calibration(
            "test",
            "val",
            temperature,
            scores(np.asarray(test_probs, dtype=np.float64), test_labels),
            scores(after, test_labels),
            len(test_labels),
        )
    halves = [np.arange(len(val_labels)) % 2 == k for k in (0, 1)]
    after = np.empty_like(val_logp)
    for fit, apply in (halves, halves[::-1]):
        t = fit_temperature(val_logp[fit], val_labels[fit])
        after[apply] = scaled(val_logp[apply], t)
    return Calibration(
        "val",
        "val (cross-fitted halves)",
        temperature,
        scores(np.asarray(val_probs, dtype=np.float64), val_labels),
        scores(after, val_labels),
        len(val_labels),
    )
