"""Per image, how well a method's scores rank the patches by their causal effect: Spearman's rho.

``rho = scipy.stats.spearmanr(scores[b], effects[b])`` for each image ``b``: Pearson's
correlation of the two rank vectors, ties given their average rank (scipy's default).
Where either vector is constant (every patch scored alike, or no single drop changes the
true-class log-probability) the ranks carry no order and rho is undefined: it is NaN, never
0, and ``mean_rho`` counts those images apart instead of averaging them in.

Two maps of the same image are also compared as Adebayo et al. ("Sanity Checks for Saliency
Maps", NeurIPS 2018) compare a map with its randomised-model counterpart: Spearman's rho of
the absolute values (``abs_spearman_per_image``: the ranking of importance regardless of
sign) and the structural similarity of the two maps on the patch grid (``ssim_per_image``).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import spearmanr
from skimage.metrics import structural_similarity

# SSIM as Wang et al. 2004 define it (skimage's settings that match their implementation):
# a Gaussian window of sigma 1.5, their constants K1 = 0.01, K2 = 0.03, population covariances.
# The patch grids (4 x 4 to 14 x 14) are smaller than or close to Wang's 11-pixel window, so the
# mean is taken over every position but a 1-patch border (skimage's ``win_size=3`` crop) rather
# than over an 11 x 11 interior that a grid this small does not have.
SSIM_SIGMA = 1.5
SSIM_CROP_WINDOW = 3


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


def abs_spearman_per_image(a, b) -> np.ndarray:
    """``(B,)`` Spearman rho between the absolute values of two ``(B, P)`` maps (NaN for a constant one)."""
    return spearman_per_image(
        np.abs(np.asarray(a, dtype=np.float64)), np.abs(np.asarray(b, dtype=np.float64))
    )


def _unit_range(m: np.ndarray) -> np.ndarray:
    """Each map scaled to [0, 1] by its own min and max (a constant map: all 0), as Adebayo et al. compare maps."""
    low = m.min(axis=-1, keepdims=True)
    span = np.ptp(m, axis=-1, keepdims=True)
    return np.divide(m - low, span, out=np.zeros_like(m), where=span > 0)


def ssim_per_image(a, b, grid: tuple[int, int]) -> np.ndarray:
    """``(B,)`` SSIM between two ``(B, P)`` maps laid out on the ``(rows, cols)`` patch grid.

    Each map is first scaled to [0, 1] on its own (``data_range=1``); SSIM is Wang et al.'s
    (Gaussian window, sigma 1.5), averaged over the grid but its 1-patch border. NaN for a grid
    with a side below 3, which has no interior.
    """
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    rows, cols = grid
    if x.shape != y.shape or x.ndim != 2 or x.shape[1] != rows * cols:
        raise ValueError(f"maps {x.shape} and {y.shape}: expected the same (B, {rows * cols})")
    out = np.full(x.shape[0], np.nan)
    if min(rows, cols) < SSIM_CROP_WINDOW:
        return out
    x, y = _unit_range(x), _unit_range(y)
    for i in range(x.shape[0]):
        out[i] = structural_similarity(
            x[i].reshape(rows, cols),
            y[i].reshape(rows, cols),
            win_size=SSIM_CROP_WINDOW,
            gaussian_weights=True,
            sigma=SSIM_SIGMA,
            use_sample_covariance=False,
            data_range=1.0,
        )
    return out
