"""The attribution report's numbers, computed from the per-image arrays every cell logged.

Per acted-on arm and method, three measures of one image each: Spearman rho between the
method's scores and the exact causal effects, and the deletion and insertion AUC of the
true-class probability (trapezoid over the fractions 0 to 1, both ends included:
``workbench.attribution.auc``). A seed's value is the mean over its images (rho: over the images
where it is defined). Over seeds: the mean and the Student-t interval (``workbench.stats``).
Each method against the random baseline is paired by seed (t-interval of the per-seed
differences, ``paired_seed_comparison``) and by seed and image (the hierarchical bootstrap,
``paired_hierarchical_bootstrap``: seeds resampled, then images within each drawn seed, the same
images for both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracking.kinds.attribution_runs import CONCENTRATION_KEYS, TOP_TOKENS, AttributionCellResult
from workbench import stats
from workbench.attribution import attention_mass_on, auc, top_mask

MEASURES = ("rho", "deletion_auc", "insertion_auc")
# Which way is more faithful: rho and insertion AUC higher, deletion AUC lower.
BETTER = {"rho": 1.0, "deletion_auc": -1.0, "insertion_auc": 1.0}
BASELINE = "random"


def per_image(cell: AttributionCellResult, method: str, measure: str) -> np.ndarray:
    """``(N,)`` one measure of every image of a cell (rho NaN where undefined)."""
    if measure == "rho":
        return np.asarray(cell.per_method("rho", method), dtype=np.float64)
    curve = "deletion_prob" if measure == "deletion_auc" else "insertion_prob"
    return auc(cell.arrays["fractions"], cell.per_method(curve, method))


def seed_value(values: np.ndarray) -> float:
    """A seed's value: the mean over the images where the measure is defined (NaN if none is)."""
    defined = values[np.isfinite(values)]
    return float(defined.mean()) if defined.size else math.nan


def _nanmean(values: np.ndarray) -> float:
    defined = values[np.isfinite(values)]
    return float(defined.mean()) if defined.size else math.nan


def mean_interval(values: dict[int, float], confidence: float) -> stats.PairedComparison:
    """Mean over seeds with its Student-t interval: the seed-paired comparison with 0 (``ci_low``, ``ci_high``)."""
    return stats.paired_seed_comparison(
        values, dict.fromkeys(values, 0.0), confidence, names=("value", "zero")
    )


def value_bootstrap(
    per_seed_a: dict[int, np.ndarray],
    per_seed_b: dict[int, np.ndarray],
    n_resamples: int,
    confidence: float,
    seed: int,
) -> stats.CI:
    """``paired_hierarchical_bootstrap`` of the seed-mean difference of per-image values, a - b.

    ``workbench.stats`` resamples examples by index with one metric ``f(labels, predicted)``;
    here an example's "label" is its position in the cell and its "prediction" its row in one
    table of every value of both methods, so ``f`` is the mean over the resampled images of
    the method's values (NaN ones left out) and both methods see the same images.
    """
    table, a, b, offset = [], {}, {}, 0
    for s in sorted(per_seed_a):
        va, vb = np.asarray(per_seed_a[s], np.float64), np.asarray(per_seed_b[s], np.float64)
        n = va.size
        position = np.arange(n)
        table += [va, vb]
        a[s], b[s] = (position, offset + position), (position, offset + n + position)
        offset += 2 * n
    values = np.concatenate(table)
    return stats.paired_hierarchical_bootstrap(
        a, b, lambda _, rows: _nanmean(values[rows]), n_resamples, confidence, seed
    )


@dataclass(frozen=True)
class MeasureRow:
    """One method's measure over the seeds of an arm, and against the random baseline."""

    method: str
    measure: str
    per_seed: dict[int, float]
    # against 0: mean_difference is the mean, ci_* its t-interval
    over_seeds: stats.PairedComparison
    undefined: dict[int, int]  # images without a value per seed (rho only)
    vs_random: stats.PairedComparison | None  # method - random per seed
    bootstrap: stats.CI | None  # method - random, hierarchical over seeds and images

    @property
    def mean(self) -> float:
        return self.over_seeds.mean_difference

    def better_in(self) -> int:
        """Seeds where the method beat the random baseline in this measure's direction."""
        if self.vs_random is None:
            return 0
        return sum(BETTER[self.measure] * d > 0 for d in self.vs_random.differences)


def faithfulness_rows(
    cells: dict[int, AttributionCellResult], n_resamples: int, confidence: float, seed: int
) -> list[MeasureRow]:
    """Every (method, measure) of one arm's cells (seed -> cell), in method order then ``MEASURES``."""
    methods = next(iter(cells.values())).methods
    rows = []
    for method in methods:
        for measure in MEASURES:
            images = {s: per_image(c, method, measure) for s, c in cells.items()}
            values = {s: seed_value(v) for s, v in images.items()}
            defined = {s: v for s, v in values.items() if math.isfinite(v)}
            over = mean_interval(defined, confidence) if defined else None
            paired = boot = None
            if method != BASELINE and BASELINE in methods and defined:
                base_images = {s: per_image(c, BASELINE, measure) for s, c in cells.items()}
                base = {s: seed_value(v) for s, v in base_images.items()}
                shared = [s for s in defined if math.isfinite(base[s])]
                if shared:
                    paired = stats.paired_seed_comparison(
                        {s: defined[s] for s in shared},
                        {s: base[s] for s in shared},
                        confidence,
                        names=(method, BASELINE),
                    )
                    boot = value_bootstrap(
                        {s: images[s] for s in shared},
                        {s: base_images[s] for s in shared},
                        n_resamples,
                        confidence,
                        seed,
                    )
            rows.append(
                MeasureRow(
                    method,
                    measure,
                    values,
                    over,
                    {s: int((~np.isfinite(v)).sum()) for s, v in images.items()},
                    paired,
                    boot,
                )
            )
    return rows


def mean_curves(
    cells: dict[int, AttributionCellResult], method: str, kind: str
) -> tuple[np.ndarray, np.ndarray]:
    """(fractions ``(F,)``, seed-major ``(S, F)`` mean true-class probability over each seed's images)."""
    seeds = sorted(cells)
    curves = np.stack(
        [cells[s].per_method(f"{kind}_prob", method).astype(np.float64).mean(axis=0) for s in seeds]
    )
    return cells[seeds[0]].arrays["fractions"], curves


@dataclass(frozen=True)
class BlockNorms:
    """Token norms of one block over an arm's seeds (per seed, then the mean where it is shown)."""

    block: int
    median: dict[int, float]  # the block's median patch-token norm
    max_ratio: dict[int, float]  # largest norm / median
    fraction: dict[int, float]  # patch tokens above k x median
    images_with: dict[int, int]  # images with at least one such token
    # their share of CLS patch attention (mean over images with one), NaN: none
    attention_share: dict[int, float]
    token_share: dict[int, float]  # their share of the patch tokens, same images
    effect_high: dict[int, float]  # mean causal effect of the high-norm tokens (NaN: none)
    effect_other: dict[int, float]  # and of the others
    # (row, col) -> high-norm tokens there, all seeds and images
    positions: dict[tuple[int, int], int]


def block_norms(cells: dict[int, AttributionCellResult]) -> list[BlockNorms]:
    """Per block: the numbers of the token-norm table, recomputed from the logged norms."""
    first = next(iter(cells.values())).arrays
    depth, cols = first["norms"].shape[0], int(first["grid"][1])
    out = []
    for block in range(depth):
        fields: dict[str, dict] = {
            k: {}
            for k in (
                "median",
                "max_ratio",
                "fraction",
                "images_with",
                "attention_share",
                "token_share",
                "effect_high",
                "effect_other",
            )
        }
        positions: dict[tuple[int, int], int] = {}
        for s in sorted(cells):
            a = cells[s].arrays
            norms, median = a["norms"][block], float(a["median_norm"][block])  # (N, P)
            high = norms > float(a["norm_threshold"]) * median
            attn = a["cls_attention"] / a["cls_attention"].sum(axis=1, keepdims=True)
            has = high.any(axis=1)
            effects = a["effects"]
            fields["median"][s] = median
            fields["max_ratio"][s] = float(norms.max() / median)
            fields["fraction"][s] = float(high.mean())
            fields["images_with"][s] = int(has.sum())
            fields["attention_share"][s] = (
                float((attn * high).sum(axis=1)[has].mean()) if has.any() else math.nan
            )
            fields["token_share"][s] = (
                float(high.mean(axis=1)[has].mean()) if has.any() else math.nan
            )
            fields["effect_high"][s] = float(effects[high].mean()) if high.any() else math.nan
            fields["effect_other"][s] = float(effects[~high].mean()) if (~high).any() else math.nan
            for patch in np.nonzero(high)[1]:
                where = divmod(int(patch), cols)
                positions[where] = positions.get(where, 0) + 1
        out.append(BlockNorms(block, positions=positions, **fields))
    return out


@dataclass(frozen=True)
class AttentionOnEffects:
    """Does CLS attend to the tokens that matter? Per seed, means over its images."""

    top: int  # tokens counted
    chance: float  # top / P: the share of uniform attention
    # CLS attention share on the ``top`` tokens of largest causal effect
    on_top_effects: dict[int, float]
    concentration: dict[int, float]  # CLS attention share on its own ``top`` most-attended tokens


def attention_on_effects(cells: dict[int, AttributionCellResult]) -> AttentionOnEffects:
    """The last block's CLS attention against the causal effects, from the logged arrays."""
    p = next(iter(cells.values())).arrays["effects"].shape[1]
    top = min(TOP_TOKENS, p)
    on, own = {}, {}
    for s, c in sorted(cells.items()):
        attention, effects = c.arrays["cls_attention"], c.arrays["effects"]
        on[s] = float(attention_mass_on(attention, top_mask(effects, top)).mean())
        own[s] = float(attention_mass_on(attention, top_mask(attention, top)).mean())
    return AttentionOnEffects(top, top / p, on, own)


@dataclass(frozen=True)
class BlockConcentration:
    """How concentrated one block's CLS attention is over an arm's seeds (seed -> mean over its images).

    Heads averaged unless said: ``entropy`` the normalised entropy over the patches (1: uniform),
    ``lowest_head_entropy`` the most concentrated head's (the lowest of the heads' means),
    ``top1`` / ``topk`` the share on the top 1 and top ``top_k`` patch tokens, ``self_share`` and
    ``registers`` the shares of the whole row on CLS itself and on the register tokens, and
    ``register_norm_ratio`` the register tokens' mean L2 norm over the block's median patch-token norm
    (empty without registers). ``workbench.attribution.concentration`` defines each.
    """

    block: int
    top_k: int
    patches: int
    registers_count: int
    entropy: dict[int, float]
    lowest_head_entropy: dict[int, float]
    top1: dict[int, float]
    topk: dict[int, float]
    self_share: dict[int, float]
    registers: dict[int, float]
    register_norm_ratio: dict[int, float]


def has_concentration(cells: dict[int, AttributionCellResult]) -> bool:
    """Whether every cell logged the concentration arrays (evidence exported before them has none)."""
    return all(all(k in c.arrays for k in CONCENTRATION_KEYS) for c in cells.values())


def block_concentration(cells: dict[int, AttributionCellResult]) -> list[BlockConcentration]:
    """Per block, the concentration of CLS attention per seed, from the logged per-image arrays."""
    first = next(iter(cells.values())).arrays
    depth, patches = first["cls_attention_entropy"].shape[0], first["effects"].shape[1]
    registers = int(first["prefix"]) - 1
    out = []
    for block in range(depth):
        fields: dict[str, dict[int, float]] = {
            k: {}
            for k in (
                "entropy",
                "lowest_head_entropy",
                "top1",
                "topk",
                "self_share",
                "registers",
                "register_norm_ratio",
            )
        }
        for s in sorted(cells):
            a = cells[s].arrays
            fields["entropy"][s] = _nanmean(a["cls_attention_entropy"][block])
            fields["lowest_head_entropy"][s] = min(
                _nanmean(h) for h in a["cls_attention_entropy_heads"][block].T
            )
            fields["top1"][s] = float(a["cls_attention_top1"][block].mean())
            fields["topk"][s] = float(a["cls_attention_topk"][block].mean())
            fields["self_share"][s] = float(a["cls_attention_on_self"][block].mean())
            fields["registers"][s] = float(a["cls_attention_on_registers"][block].mean())
            if registers:
                ratio = a["prefix_norms"][block][:, 1:].mean() / float(a["median_norm"][block])
                fields["register_norm_ratio"][s] = float(ratio)
        out.append(
            BlockConcentration(block, int(first["attention_top_k"]), patches, registers, **fields)
        )
    return out
