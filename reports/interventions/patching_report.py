"""The activation-patching section of an intervention report: the maps and their bands over seeds.

Per acted-on arm, from every cell's ``interventions/patching.npz``
(``workbench.interventions.patching``): the fraction of the clean-vs-corrupted logit
difference restored by patching block i's output at one token position (blocks x
positions), one branch (blocks x attention / MLP) and one head (blocks x heads), each a mean
over seeds with its t-interval over seeds; and how far the seeds agree on which blocks and
positions matter (Spearman correlation of their maps). Blocks and token positions are the
same places in every seed's model; heads are not (a head index names a different head in a
separately trained model), so the heads map is read per block.

Both directions where the cells ran them (Heimersheim and Nanda 2024): denoising (clean into
the corrupted run: fraction restored) and noising (corrupted into the clean run: fraction
removed); evidence from before noising has denoising only, and the section says so.

The seeds' agreement leaves out the residual locations fixed by construction (0 or 1 in every
model, e.g. the last block under a class-token head): they would agree whatever the models
learnt. The cells' ``resid_reads`` (``workbench.interventions.patching.readout_reads``) name
them; evidence without it is read for locations whose patched logit difference equals the
corrupted run's (or the clean run's) exactly in every pair of every seed, and the section says so.
"""

from __future__ import annotations

import itertools

import numpy as np
from matplotlib.figure import Figure as MplFigure
from scipy import stats as sps

from reports.figures import report_png
from reports.render import Block, Figure, Heading, Para, Table
from workbench.interventions.patching import (
    DIRECTIONS,
    effect_fraction,
    fixed_by_construction,
)
from reports.content.rounding import fmt


def seed_band(
    maps: dict[int, np.ndarray], confidence: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds and the t-interval's ends, elementwise (NaN ends with one seed)."""
    stack = np.stack([maps[s] for s in sorted(maps)]).astype(np.float64)  # (S, ...)
    mean = stack.mean(axis=0)
    n = stack.shape[0]
    if n < 2:
        nan = np.full_like(mean, np.nan)
        return mean, nan, nan
    half = sps.t.ppf(0.5 + confidence / 2, n - 1) * stack.std(axis=0, ddof=1) / np.sqrt(n)
    return mean, mean - half, mean + half


def effect_maps(
    cells: dict[int, dict], key: str, direction: str = "denoising"
) -> dict[int, np.ndarray]:
    prefix = DIRECTIONS[direction]
    return {
        s: effect_fraction(direction, z[f"{prefix}{key}_ld"], z["clean_ld"], z["corrupted_ld"])
        for s, z in cells.items()
    }


def has_noising(cells: dict[int, dict]) -> bool:
    return all("noising_resid_ld" in z for z in cells.values())


def fixed_locations(cells: dict[int, dict]) -> tuple[np.ndarray, bool]:
    """``(depth, tokens)`` residual locations fixed by construction, and whether the model said so.

    From every cell's ``resid_reads`` (a location fixed in any seed's model is left out);
    evidence without it: locations whose patched logit difference equals the corrupted run's,
    or the clean run's, bitwise in every pair of every seed.
    """
    if all("resid_reads" in z for z in cells.values()):
        return np.any(
            [fixed_by_construction(z["resid_reads"]) for z in cells.values()], axis=0
        ), True
    fixed = None
    for z in cells.values():
        ld = z["resid_ld"]
        same = (ld == z["corrupted_ld"][:, None, None]).all(axis=0) | (
            ld == z["clean_ld"][:, None, None]
        ).all(axis=0)
        fixed = same if fixed is None else fixed & same
    return fixed, False


def spearman_pairs(maps: dict[int, np.ndarray], keep: np.ndarray | None = None) -> list[float]:
    """Spearman rho between every two seeds' maps over the ``keep`` locations (default: all)."""
    out = []
    for a, b in itertools.combinations(sorted(maps), 2):
        x, y = maps[a], maps[b]
        if keep is not None:
            x, y = x[keep], y[keep]
        x, y = x.ravel(), y.ravel()
        if x.size > 2 and np.ptp(x) > 0 and np.ptp(y) > 0:
            out.append(float(sps.spearmanr(x, y).statistic))
    return out


def _agreement(rho: list[float]) -> str:
    if not rho:
        return "n/a"
    return f"{fmt(float(np.mean(rho)), 2)} [{fmt(min(rho), 2)}, {fmt(max(rho), 2)}]"


def agreement_blocks(cells: dict[int, dict], arm: str, level: int) -> list[Block]:
    """The seeds' agreement on the blocks x positions maps, per block, over the free locations.

    Under its own heading: a published report's sections keep their numbers on a rebuild.
    """
    fixed, from_model = fixed_locations(cells)
    directions = ["denoising", "noising"] if has_noising(cells) else ["denoising"]
    maps = {d: effect_maps(cells, "resid", d) for d in directions}
    depth = fixed.shape[0]
    rows = []
    for i in range(depth):
        keep = np.zeros_like(fixed)
        keep[i] = ~fixed[i]
        rows.append(
            [str(i), f"{int(keep.sum())} of {fixed.shape[1]}"]
            + [_agreement(spearman_pairs(maps[d], keep)) for d in directions]
        )
    rows.append(
        [f"blocks 0-{depth - 1}", f"{int((~fixed).sum())} of {fixed.size}"]
        + [_agreement(spearman_pairs(maps[d], ~fixed)) for d in directions]
    )
    how = (
        "named by the models themselves (the logits' gradient with respect to each block's output "
        "is exactly zero there, or one position alone is read)"
        if from_model
        else "found in the data, as this evidence predates the models' own map of them "
        "(`resid_reads`): the patched logit difference equals the corrupted run's (fraction 0) or "
        "the clean run's (fraction 1) bitwise in every pair of every seed"
    )
    said = [
        "Spearman correlation between every two seeds' blocks x positions maps, mean [min, max] "
        f"over the {len(list(itertools.combinations(cells, 2)))} pairs of seeds, per block over the "
        "locations not fixed by construction. Fixed locations (0 or 1 in every model whatever it "
        f"learnt, which agree by construction) are {how}; left out: {int(fixed.sum())} of "
        f"{fixed.size}."
    ]
    if not has_noising(cells):
        said.append("This evidence predates noising: only denoising was run.")
    return [
        Heading(level, f"Seed agreement without the fixed locations ({arm})"),
        Para(" ".join(said)),
        Table(
            ["block", "free positions", *[f"{d} ρ" for d in directions]],
            rows,
            align=["l", "r", *["r"] * len(directions)],
        ),
    ]


def heatmaps(
    panels: list[tuple[str, np.ndarray, str]],
    title: str,
    ticks: list[str] | None = None,
    to_data: bool = False,
) -> bytes:
    """Block rows x ``panels``' columns on one colour scale; ``ticks`` names the columns.

    The scale runs to +-1 (the whole logit difference) or further; ``to_data``: to the largest
    value shown, for maps whose values are all small (a patch position's share)."""
    fig = MplFigure(figsize=(4.2 * len(panels), 0.6 * panels[0][1].shape[0] + 1.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    finite = np.concatenate([g[np.isfinite(g)] for _, g, _ in panels])
    largest = float(np.abs(finite).max()) if finite.size else 0.0
    lim = (largest or 1.0) if to_data else max(1.0, largest)  # one scale for all panels
    for ax, (name, grid, xlabel) in zip(axes, panels):
        im = ax.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("block")
        ax.set_yticks(range(grid.shape[0]))
        if ticks is not None:
            ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return report_png(fig)


def interval_cell(mean: float, lo: float, hi: float) -> str:
    if not np.isfinite(mean):
        return "n/a"
    band = f" [{fmt(lo, 2)}, {fmt(hi, 2)}]" if np.isfinite(lo) else ""
    return f"{fmt(mean, 2)}{band}"


def patching_blocks(
    arm: str, cells: dict[int, dict], protocol, level: int, prefix_tokens: int
) -> list[Block]:
    """The section for one arm; ``cells`` maps each seed to its ``patching.npz`` arrays."""
    if not cells:
        return []
    spec, conf = protocol.patching, protocol.evaluation.confidence
    first = next(iter(cells.values()))
    pairs = len(first["clean_ld"])
    resid, branch, head = (
        effect_maps(cells, "resid"),
        effect_maps(cells, "branch"),
        effect_maps(cells, "head"),
    )
    r_mean, r_lo, r_hi = seed_band(resid, conf)
    b_mean, b_lo, b_hi = seed_band(branch, conf)
    h_mean, h_lo, h_hi = seed_band(head, conf)
    depth, tokens = r_mean.shape
    corruption = (
        "the corrupting image itself"
        if spec.corruption == "class"
        else f"the clean image with {spec.replaced_patches} of its patches (seeded positions) "
        "taken from the corrupting image"
    )
    gaps = ", ".join(
        fmt(float(np.mean(z["clean_ld"]) - np.mean(z["corrupted_ld"])), 2)
        for _, z in sorted(cells.items())
    )
    blocks: list[Block] = [
        Heading(level, f"Activation patching ({arm})"),
        Para(
            f"{pairs} pairs (seed {spec.seed}, the same in every model): a clean image and a "
            f"corrupting image of another class; the corrupted input is {corruption}. The "
            "corrupted run is repeated with one clean activation patched in; the number is the "
            "fraction of the clean-vs-corrupted logit difference (clean label minus the corrupting "
            "image's label) restored, a ratio of means over the pairs: 0 nothing restored, 1 the "
            f"clean run's difference. Clean minus corrupted logit difference per seed: {gaps}. "
            f"Brackets: {conf:.0%} t-interval over {len(cells)} seeds."
        ),
    ]
    positions = ["cls" if t < prefix_tokens else f"p{t - prefix_tokens}" for t in range(tokens)]
    blocks.append(
        Figure(
            f"patching_resid_{arm}.png",
            (
                "Fraction restored when block i's output (`blocks.i.resid2`) at one token position "
                "is patched from the clean run (x: token position, prefix tokens first, then the "
                "patches row by row). Left: mean over seeds; middle and right: the ends of the "
                f"{conf:.0%} t-interval over seeds."
            ),
            heatmaps(
                [
                    ("mean over seeds", r_mean, "token position"),
                    ("interval low", r_lo, "token position"),
                    ("interval high", r_hi, "token position"),
                ],
                f"{protocol.name}: {arm}, residual stream patched at one position",
            ),
        )
    )
    top = np.argsort(-np.nan_to_num(r_mean, nan=-np.inf), axis=1)[:, :3]
    blocks.append(
        Table(
            ["block", "best positions: fraction restored [interval]", "branch attn", "branch mlp"],
            [
                [
                    str(i),
                    "; ".join(
                        f"{positions[t]} {interval_cell(r_mean[i, t], r_lo[i, t], r_hi[i, t])}"
                        for t in top[i]
                    ),
                    interval_cell(b_mean[i, 0], b_lo[i, 0], b_hi[i, 0]),
                    interval_cell(b_mean[i, 1], b_lo[i, 1], b_hi[i, 1]),
                ]
                for i in range(depth)
            ],
            align=["r", "l", "r", "r"],
        )
    )
    blocks.append(
        Figure(
            f"patching_heads_{arm}.png",
            (
                "Fraction restored when one head's output (`blocks.i.attn.z`, every position) is "
                "patched from the clean run: mean over seeds and the interval's ends. Heads of "
                "separately trained seeds do not correspond by index: read a row as how much any "
                "single head of that block carries."
            ),
            heatmaps(
                [
                    ("mean over seeds", h_mean, "head"),
                    ("interval low", h_lo, "head"),
                    ("interval high", h_hi, "head"),
                ],
                f"{protocol.name}: {arm}, one head patched",
            ),
        )
    )
    rho = spearman_pairs(resid)
    blocks.append(
        Para(
            "Seed agreement on the blocks x positions map over every location (Spearman "
            "correlation between every two seeds), the locations fixed by construction included, "
            "which agree whatever the models learnt (read per block without them below): "
            + (
                f"mean {fmt(float(np.mean(rho)), 2)}, min {fmt(min(rho), 2)}, max "
                f"{fmt(max(rho), 2)} over {len(rho)} pairs."
                if rho
                else "not computable (fewer than two seeds with varying maps)."
            )
        )
    )
    if has_noising(cells):
        blocks += _noising_blocks(arm, cells, protocol, conf, positions, level + 1)
    blocks += agreement_blocks(cells, arm, level + 1)
    return blocks


def _noising_blocks(arm, cells, protocol, conf, positions, level: int) -> list[Block]:
    """Noising: the corrupted run's activation patched into the clean run (fraction removed)."""
    n_mean, n_lo, n_hi = seed_band(effect_maps(cells, "resid", "noising"), conf)
    nb_mean, nb_lo, nb_hi = seed_band(effect_maps(cells, "branch", "noising"), conf)
    top = np.argsort(-np.nan_to_num(n_mean, nan=-np.inf), axis=1)[:, :3]
    return [
        Heading(level, f"Noising ({arm})"),
        Para(
            "Noising (Heimersheim and Nanda 2024): the clean run repeated with one activation of the "
            "corrupted run patched in; the number is the fraction of the clean-vs-corrupted logit "
            "difference removed, a ratio of means over the pairs: 0 nothing removed, 1 the corrupted "
            "run's difference. Denoising (above) asks whether a location suffices to bring the clean "
            "answer back; noising whether the clean answer needs it."
        ),
        Figure(
            f"patching_noising_resid_{arm}.png",
            (
                "Fraction removed when block i's output (`blocks.i.resid2`) at one token position "
                "is patched from the corrupted run into the clean run: mean over seeds and the ends "
                f"of the {conf:.0%} t-interval over seeds."
            ),
            heatmaps(
                [
                    ("mean over seeds", n_mean, "token position"),
                    ("interval low", n_lo, "token position"),
                    ("interval high", n_hi, "token position"),
                ],
                f"{protocol.name}: {arm}, noising, residual stream patched at one position",
            ),
        ),
        Table(
            [
                "block",
                "noising, best positions: fraction removed [interval]",
                "branch attn",
                "branch mlp",
            ],
            [
                [
                    str(i),
                    "; ".join(
                        f"{positions[t]} {interval_cell(n_mean[i, t], n_lo[i, t], n_hi[i, t])}"
                        for t in top[i]
                    ),
                    interval_cell(nb_mean[i, 0], nb_lo[i, 0], nb_hi[i, 0]),
                    interval_cell(nb_mean[i, 1], nb_lo[i, 1], nb_hi[i, 1]),
                ]
                for i in range(n_mean.shape[0])
            ],
            align=["r", "l", "r", "r"],
        ),
    ]
