"""Where a ``patches`` corruption's information sits: patching readings split by each pair's own patches.

With ``corruption: patches`` (``workbench.interventions.patching``) each pair's corrupted image is
the clean image with K of its patches, at positions drawn per pair, taken from an image of
another class. A map averaged over pairs by token position blurs that: position 7 is replaced in
some pairs and untouched in the others. So each pair's patched logit differences are split by
its own positions first, then the fraction restored (removed) is taken as everywhere else, a
ratio of means over the pairs:

- ``prefix``: the prefix tokens (the class token and any registers: no image content);
- ``replaced``: a patch token whose patch the corruption replaced (the mean over the pair's K);
- ``untouched``: a patch token whose patch it left alone (the mean over the other patches).

Per block, for the residual stream and, where the cells patched per position (``positions``), for
each branch and for the largest single head of the block at each position (heads do not correspond
across seeds, so a block's heads are read as "the one that carries most there").
"""

from __future__ import annotations

import numpy as np

from workbench.interventions.patching import DIRECTIONS, effect_fraction

PLACES = ("prefix", "replaced", "untouched")


def replaced_tokens(replaced: np.ndarray, tokens: int, prefix: int) -> np.ndarray:
    """(P, tokens) bool: the token positions of each pair's replaced patches."""
    mask = np.zeros((len(replaced), tokens), dtype=bool)
    rows = np.repeat(np.arange(len(replaced)), replaced.shape[1])
    mask[rows, prefix + replaced.reshape(-1)] = True
    return mask


def _place_means(ld: np.ndarray, mask: np.ndarray, prefix: int) -> dict[str, np.ndarray]:
    """``ld`` (P, ..., tokens) averaged per pair over each place's positions: (P, ...) each."""
    shape = (len(mask),) + (1,) * (ld.ndim - 2) + (mask.shape[1],)
    replaced = mask.reshape(shape)
    patch = np.zeros(mask.shape[1], dtype=bool)
    patch[prefix:] = True
    untouched = (~mask & patch).reshape(shape)
    out = {"prefix": ld[..., :prefix].astype(np.float64).mean(axis=-1)}
    for name, where in (("replaced", replaced), ("untouched", untouched)):
        count = where.sum(axis=-1)
        out[name] = np.where(where, ld, 0.0).astype(np.float64).sum(axis=-1) / count
    return out


def localisation(
    z: dict[str, np.ndarray], prefix: int, key: str = "resid", direction: str = "denoising"
) -> dict[str, np.ndarray]:
    """One cell's fraction restored (removed) per place, from its ``patching.npz`` arrays.

    Args:
        key: ``resid`` -> (depth,) per place; ``branch_pos`` -> (depth, 2) (attention, MLP);
            ``head_pos`` -> (depth,): the largest single head of each block, per place.
        direction: ``denoising`` (fraction restored) or ``noising`` (fraction removed).
    """
    ld = z[f"{DIRECTIONS[direction]}{key}_ld"]
    mask = replaced_tokens(z["replaced"], ld.shape[-1], prefix)
    places = _place_means(ld, mask, prefix)
    out = {
        place: effect_fraction(direction, value, z["clean_ld"], z["corrupted_ld"])
        for place, value in places.items()
    }
    if key == "head_pos":  # (depth, heads) -> the largest head of each block
        out = {place: value.max(axis=-1) for place, value in out.items()}
    return out


def has_places(cells: dict[int, dict]) -> bool:
    """Whether every cell's pairs replaced patches (``corruption: patches``)."""
    return bool(cells) and all(
        "replaced" in z and z["replaced"].ndim == 2 and z["replaced"].shape[1] > 0
        for z in cells.values()
    )


def has_positions(cells: dict[int, dict]) -> bool:
    """Whether every cell patched each branch and head per position (``positions``)."""
    return bool(cells) and all("branch_pos_ld" in z and "head_pos_ld" in z for z in cells.values())
