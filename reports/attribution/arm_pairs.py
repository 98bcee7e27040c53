"""Arm against arm in an attribution report (``workbench report --compare A:B``).

Two arms of the acted-on study scored on the same images (the protocol's first N images of
one split) are paired by seed and image: for each method and measure, a - b of the seed means
with its t-interval over seeds and the hierarchical bootstrap over seeds then images
(``reports.attribution.faithfulness``), and the same difference taken after each arm's own
random draws are subtracted per image, which removes what a change of model does to every
order alike (a model that survives deletion better lowers every deletion curve, map or not).
Beside it, per block, what the two arms' tokens and CLS attention look like: the share of
high-norm patch tokens, the largest norm over the block's median, and where the class
token's attention goes (``block_norms``, ``block_concentration``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reports.attribution.control_blocks import CUT, WORDS, difference_interval
from reports.attribution.controls import has_draws
from reports.attribution.faithfulness import (
    BASELINE,
    BETTER,
    MEASURES,
    block_concentration,
    block_norms,
    has_concentration,
    per_image,
    seed_value,
    value_bootstrap,
)
from reports.render import Block, Heading, Para, Table
from tracking.kinds.attribution_runs import AttributionCellResult
from workbench import stats
from reports.content.rounding import bootstrap_display, fmt

D = 3  # decimals, as the rest of the attribution report
Cells = dict[int, AttributionCellResult]


class ArmPairError(ValueError):
    """Two arms that cannot be paired (no shared seed, or different images); the message says why."""


@dataclass(frozen=True)
class ArmDifference:
    """One method's measure, arm a minus arm b, over the seeds both arms have."""

    method: str
    measure: str
    mean_a: float
    mean_b: float
    versus: stats.PairedComparison  # a - b per seed
    bootstrap: stats.CI  # a - b, seeds then images
    beyond_draws: stats.PairedComparison | None  # (a - a's draws) - (b - b's draws) per seed

    def settled(self) -> int:
        """+1 / -1 where both intervals lie on one side of zero (+1: a is the more faithful), else 0."""
        lows = (self.versus.ci_low, self.bootstrap.low)
        highs = (self.versus.ci_high, self.bootstrap.high)
        if all(math.isfinite(x) and x > 0 for x in lows):
            return int(BETTER[self.measure])
        if all(math.isfinite(x) and x < 0 for x in highs):
            return -int(BETTER[self.measure])
        return 0


def shared_seeds(a: str, b: str, cells_a: Cells, cells_b: Cells) -> list[int]:
    """The seeds both arms have, each scored on the same images (refused otherwise)."""
    seeds = sorted(set(cells_a) & set(cells_b))
    if not seeds:
        raise ArmPairError(f"--compare {a}:{b}: the two arms have no reported seed in common")
    for s in seeds:
        if not np.array_equal(cells_a[s].arrays["indices"], cells_b[s].arrays["indices"]):
            raise ArmPairError(
                f"--compare {a}:{b}: seed {s}'s cells scored different images, so they cannot be paired"
            )
    return seeds


def _beyond_draws(cell: AttributionCellResult, method: str, measure: str) -> np.ndarray:
    """Per image: the method's measure minus the mean of the cell's random draws on that image."""
    draws = cell.arrays[f"random_draws/{measure}"].astype(np.float64)
    with np.errstate(all="ignore"):
        return per_image(cell, method, measure) - np.nanmean(draws, axis=0)


def arm_differences(
    cells_a: Cells, cells_b: Cells, seeds: list[int], n_resamples: int, confidence: float, seed: int
) -> list[ArmDifference]:
    """Every method both arms scored, per measure, in method order then ``MEASURES``."""
    first_a, first_b = cells_a[seeds[0]], cells_b[seeds[0]]
    methods = [m for m in first_a.methods if m in first_b.methods]
    draws = all(has_draws({s: c[s] for s in seeds}) for c in (cells_a, cells_b))
    out = []
    for method in methods:
        for measure in MEASURES:
            images_a = {s: per_image(cells_a[s], method, measure) for s in seeds}
            images_b = {s: per_image(cells_b[s], method, measure) for s in seeds}
            va = {s: seed_value(v) for s, v in images_a.items()}
            vb = {s: seed_value(v) for s, v in images_b.items()}
            shared = [s for s in seeds if math.isfinite(va[s]) and math.isfinite(vb[s])]
            if not shared:  # undefined in every seed (a constant map has no rho): no row
                continue
            versus = stats.paired_seed_comparison(
                {s: va[s] for s in shared}, {s: vb[s] for s in shared}, confidence, names=("a", "b")
            )
            boot = value_bootstrap(
                {s: images_a[s] for s in shared},
                {s: images_b[s] for s in shared},
                n_resamples,
                confidence,
                seed,
            )
            beyond = None
            if draws and method != BASELINE:
                ba = {s: seed_value(_beyond_draws(cells_a[s], method, measure)) for s in shared}
                bb = {s: seed_value(_beyond_draws(cells_b[s], method, measure)) for s in shared}
                beyond = stats.paired_seed_comparison(ba, bb, confidence, names=("a", "b"))
            out.append(
                ArmDifference(
                    method,
                    measure,
                    float(np.mean([va[s] for s in shared])),
                    float(np.mean([vb[s] for s in shared])),
                    versus,
                    boot,
                    beyond,
                )
            )
    return out


def _mean(values: dict[int, float], seeds: list[int]) -> float:
    shown = [values[s] for s in seeds if s in values and math.isfinite(values[s])]
    return float(np.mean(shown)) if shown else math.nan


def _both(a: float, b: float, decimals: int) -> str:
    return f"{fmt(a, decimals)} / {fmt(b, decimals)}"


def structure_table(
    a: str, b: str, cells_a: Cells, cells_b: Cells, seeds: list[int], norm_threshold: float
) -> Table:
    """Per block, a's and b's token norms and CLS attention, means over the shared seeds."""
    norms_a, norms_b = block_norms(cells_a), block_norms(cells_b)
    both = has_concentration(cells_a) and has_concentration(cells_b)
    conc_a = block_concentration(cells_a) if both else []
    conc_b = block_concentration(cells_b) if both else []
    header = [
        "block",
        f"high-norm patch tokens, % ({a} / {b})",
        "largest norm ÷ median",
    ]
    if both:
        header += ["CLS attention entropy", "CLS attention on itself", "on the registers"]
    rows = []
    for i, (na, nb) in enumerate(zip(norms_a, norms_b, strict=True)):
        row = [
            str(na.block + 1),
            _both(100 * _mean(na.fraction, seeds), 100 * _mean(nb.fraction, seeds), 2),
            _both(_mean(na.max_ratio, seeds), _mean(nb.max_ratio, seeds), 1),
        ]
        if both:
            ca, cb = conc_a[i], conc_b[i]
            registers = [
                fmt(_mean(c.registers, seeds), D) if c.registers_count else "–" for c in (ca, cb)
            ]
            row += [
                _both(_mean(ca.entropy, seeds), _mean(cb.entropy, seeds), D),
                _both(_mean(ca.self_share, seeds), _mean(cb.self_share, seeds), D),
                " / ".join(registers),
            ]
        rows.append(row)
    return Table(
        header,
        rows,
        ["r"] + ["r"] * (len(header) - 1),
        [
            f"Each cell: `{a}` / `{b}`, the mean over seeds {', '.join(map(str, seeds))}. High-norm: a patch "
            f"token whose L2 norm after the block exceeds {norm_threshold:g} × the block's median patch-token "
            "norm (each arm's own median). CLS attention (heads averaged): its normalised entropy over the patch "
            "tokens (1: uniform) and the share of the class token's whole row on itself and on the register "
            "tokens (–: the arm has none)."
        ],
    )


def pair_blocks(
    a: str,
    b: str,
    cells_a: Cells,
    cells_b: Cells,
    *,
    n_resamples: int,
    confidence: float,
    seed: int,
    norm_threshold: float,
    split: str,
) -> list[Block]:
    """The section of one ``--compare A:B`` pair: a sentence, the differences and the structure."""
    seeds = shared_seeds(a, b, cells_a, cells_b)
    rows = arm_differences(cells_a, cells_b, seeds, n_resamples, confidence, seed)
    body = []
    for r in rows:
        shown = bootstrap_display(r.bootstrap, 1.0, "", max_decimals=4, estimate_decimals=D)
        beyond = (
            f"{fmt(r.beyond_draws.mean_difference, D, True)} "
            + difference_interval(r.measure, r.beyond_draws.ci_low, r.beyond_draws.ci_high)
            if r.beyond_draws is not None
            else "–"
        )
        mark = {1: " ✓", -1: " ✗", 0: ""}[r.settled()]
        body.append(
            [
                f"`{r.method}`",
                WORDS[r.measure],
                _both(r.mean_a, r.mean_b, D),
                fmt(r.versus.mean_difference, D, True) + mark,
                difference_interval(r.measure, r.versus.ci_low, r.versus.ci_high),
                f"[{shown.low}, {shown.high}]",
                " / ".join(fmt(x, D, True) for x in r.versus.differences),
                beyond,
            ]
        )
    better = [f"`{r.method}` ({WORDS[r.measure]})" for r in rows if r.settled() == 1]
    worse = [f"`{r.method}` ({WORDS[r.measure]})" for r in rows if r.settled() == -1]
    sentence = (
        f"On the same {len(cells_a[seeds[0]].arrays['labels']):,} {split} images and seeds "
        f"{', '.join(map(str, seeds))}, `{a}` − `{b}`: of {len(rows)} method-measure pairs, both intervals "
        f"put `{a}` on the more faithful side in {len(better)}"
        + (f" ({', '.join(better)})" if better else "")
        + f" and on the less faithful side in {len(worse)}"
        + (f" ({', '.join(worse)})" if worse else "")
        + "; the others are not settled by these seeds and images. A difference here compares two "
        "models' maps against each model's own token drops, not one map against another."
    )
    return [
        Heading(3, f"`{a}` against `{b}`"),
        Para(sentence),
        Table(
            [
                "method",
                "measure",
                f"{a} / {b}",
                "a − b",
                f"{confidence:.0%} t-interval",
                "bootstrap",
                "per seed",
                "a − b beyond the random draws",
            ],
            body,
            ["l", "l", "r", "r", "r", "r", "r", "r"],
            [
                f"a = `{a}`, b = `{b}`; paired by seed (t-interval over the per-seed differences) and by seed "
                f"and image (bootstrap hierarchical over seeds then images, {n_resamples:,} resamples). ✓ / ✗: both "
                f"intervals put `{a}` on the more / less faithful side (lower deletion AUC, higher ρ and "
                "insertion AUC). Beyond the random draws: the same difference after subtracting, per image, the "
                "mean of each arm's own random orders, with its t-interval over seeds. " + CUT
            ],
            css_class="wide",
        ),
        structure_table(a, b, cells_a, cells_b, seeds, norm_threshold),
    ]
