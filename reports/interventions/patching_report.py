"""The activation-patching section of an intervention report: the maps and their bands over seeds.

Per acted-on arm, from every cell's ``interventions/patching.npz``
(``workbench.interventions.patching``): the fraction of the clean-vs-corrupted logit
difference restored by patching block i's output at one token position (blocks x
positions), one branch (blocks x attention / MLP) and one head (blocks x heads), each a mean
over seeds with its t-interval over seeds; and how far the seeds agree on which blocks and
positions matter (Spearman correlation of their maps), over the places not fixed by construction
only: a place whose fraction is the same in every seed (the last block's output is the head's
input, so its class token restores 1 and, with class-token pooling, its patches 0) would make any
two seeds agree whatever their models learned. Blocks and token positions are the
same places in every seed's model; heads are not (a head index names a different head in a
separately trained model), so the heads map is read per block.
"""

from __future__ import annotations

import itertools

import numpy as np
from matplotlib.figure import Figure as MplFigure
from scipy import stats as sps

from reports.figures import report_png
from reports.render import Block, Figure, Heading, Para, Table
from workbench.interventions.patching import restored_fraction
from workbench.report_content.rounding import fmt


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


def _maps(cells: dict[int, dict], key: str) -> dict[int, np.ndarray]:
    return {
        s: restored_fraction(z[f"{key}_ld"], z["clean_ld"], z["corrupted_ld"])
        for s, z in cells.items()
    }


def fixed_by_construction(maps: dict[int, np.ndarray]) -> np.ndarray:
    """Boolean mask of the places whose value is the same in every seed (at least two seeds).

    Patching the last block's output patches the head's input: its class token restores exactly
    1 and, with class-token pooling, its patch positions exactly 0 in every model, so those places
    say nothing about whether the seeds learned the same thing.
    """
    stack = np.stack([maps[s] for s in sorted(maps)]).astype(np.float64)
    if stack.shape[0] < 2:
        return np.zeros(stack.shape[1:], dtype=bool)
    return np.all(stack == stack[0], axis=0)


def seed_agreement(maps: dict[int, np.ndarray], keep: np.ndarray | None = None) -> list[float]:
    """Spearman correlation of every two seeds' maps over the places in ``keep`` (default: the
    places not fixed by construction); a pair where either map is constant there is left out."""
    if keep is None:
        keep = ~fixed_by_construction(maps)
    out = []
    for a, b in itertools.combinations(sorted(maps), 2):
        x, y = maps[a][keep], maps[b][keep]
        if x.size > 1 and np.ptp(x) > 0 and np.ptp(y) > 0:
            out.append(float(sps.spearmanr(x, y).statistic))
    return out


def _agreement_text(rho: list[float]) -> str:
    if not rho:
        return "not computable (fewer than two seeds with varying maps)"
    return (
        f"mean {fmt(float(np.mean(rho)), 2)}, min {fmt(min(rho), 2)}, max {fmt(max(rho), 2)} "
        f"over {len(rho)} pairs"
    )


def _agreement(resid: dict[int, np.ndarray], prefix_tokens: int) -> Para:
    """The seeds' agreement over the free places, and per block over its free patch positions."""
    fixed = fixed_by_construction(resid)
    free = int((~fixed).sum())
    per_block = []
    for i in range(fixed.shape[0]):
        keep = np.zeros_like(fixed)
        keep[i, prefix_tokens:] = ~fixed[i, prefix_tokens:]
        if keep.sum() > 1:
            per_block.append(f"block {i} {_agreement_text(seed_agreement(resid, keep))}")
    return Para(
        "Seed agreement on the blocks x positions map (Spearman correlation between every two "
        f"seeds) over the {free} of {fixed.size} places not fixed by construction (a place with "
        "the same value in every seed, such as the last block's, whose class token is the head's "
        f"input, is left out): {_agreement_text(seed_agreement(resid))}."
        + (
            f" Over each block's patch positions alone: {'; '.join(per_block)}."
            if per_block
            else ""
        )
    )


def _heatmaps(panels: list[tuple[str, np.ndarray, str]], title: str) -> bytes:
    fig = MplFigure(figsize=(4.2 * len(panels), 0.6 * panels[0][1].shape[0] + 1.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    finite = np.concatenate([g[np.isfinite(g)] for _, g, _ in panels])
    lim = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0  # one scale for all panels
    for ax, (name, grid, xlabel) in zip(axes, panels):
        im = ax.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("block")
        ax.set_yticks(range(grid.shape[0]))
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return report_png(fig)


def _cell(mean: float, lo: float, hi: float) -> str:
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
    resid, branch, head = _maps(cells, "resid"), _maps(cells, "branch"), _maps(cells, "head")
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
            _heatmaps(
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
                        f"{positions[t]} {_cell(r_mean[i, t], r_lo[i, t], r_hi[i, t])}"
                        for t in top[i]
                    ),
                    _cell(b_mean[i, 0], b_lo[i, 0], b_hi[i, 0]),
                    _cell(b_mean[i, 1], b_lo[i, 1], b_hi[i, 1]),
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
            _heatmaps(
                [
                    ("mean over seeds", h_mean, "head"),
                    ("interval low", h_lo, "head"),
                    ("interval high", h_hi, "head"),
                ],
                f"{protocol.name}: {arm}, one head patched",
            ),
        )
    )
    blocks.append(_agreement(resid, prefix_tokens))
    return blocks
