"""Per image, how well a method's scores rank the patches by their causal effect: Spearman's rho.

``rho = scipy.stats.spearmanr(scores[b], effects[b])`` for each image ``b``: Pearson's
correlation of the two rank vectors, ties given their average rank (scipy's default).
Where either vector is constant (every patch scored alike, or no single drop changes the
true-class log-probability) the ranks carry no order and rho is undefined: it is NaN, never
0, and ``mean_rho`` counts those images apart instead of averaging them in.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import spearmanr


def spearman_per_image(scores, effects) -> np.ndarray:
    """``(B,)`` Spearman rho between each image's ``(P,)`` scores and effects; NaN for a constant vector."""
    s = np.asarray(scores, dtype=np.float64)
    e = np.asarray(effects, dtype=np.float64)
    if s.shape != e.shape or s.ndim != 2:
        raise ValueError(f"scores {s.shape} and effects {e.shape}: expected the same (B, P)")
    rho = np.full(s.shape[0], np.nan)
    for b in range(s.shape[0]):
        if (
            np.ptp(s[b]) > 0 and np.ptp(e[b]) > 0
        ):  # scipy warns and returns NaN otherwise: say so here instead
            rho[b] = spearmanr(s[b], e[b]).statistic
    return rho


def mean_rho(rho) -> tuple[float, int]:
    """(mean over the images where rho is defined, number of images where it is not)."""
    r = np.asarray(rho, dtype=np.float64)
    defined = np.isfinite(r)
    return (float(r[defined].mean()) if defined.any() else float("nan")), int((~defined).sum())


def top_mask(values, top: int) -> np.ndarray:
    """``(B, P)`` bool: each row's ``top`` largest values (ties: the lower index first, as the curves' order)."""
    v = np.asarray(values, dtype=np.float64)
    if not 1 <= top <= v.shape[1]:
        raise ValueError(f"top={top!r}: must be in 1..{v.shape[1]}")
    order = np.argsort(-v, axis=1, kind="stable")[:, :top]
    mask = np.zeros(v.shape, dtype=bool)
    np.put_along_axis(mask, order, True, axis=1)
    return mask


def attention_mass_on(attention, chosen) -> np.ndarray:
    """``(B,)`` share of each row's attention mass over the patches that falls on the ``chosen`` ``(B, P)`` tokens."""
    a = np.asarray(attention, dtype=np.float64)
    return (a * np.asarray(chosen, dtype=bool)).sum(axis=1) / a.sum(axis=1)
