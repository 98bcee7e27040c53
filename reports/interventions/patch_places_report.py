"""Two parts of the activation-patching section that only some studies have.

- **Where the corruption sits** (``corruption: patches``): per block, the fraction a residual patch
  restores (removes) at the prefix tokens, at a patch the corruption replaced and at one it left
  alone, each pair read at its own positions (``reports.interventions.patch_localisation``);
  with per-position patches, the same for each branch and for a block's largest head.
- **Branches and heads per position** (``positions``): maps blocks x token position of the fraction
  restored by patching the attention or MLP branch, or the block's largest single head, at one
  position (heads do not correspond across seeds: per seed the largest head at each position).

Each number is a mean over seeds with its t-interval over seeds, as in the rest of the section.
"""

from __future__ import annotations

import numpy as np

from reports.interventions.patching_report import effect_maps, heatmaps, interval_cell, seed_band
from reports.render import Block, Figure, Heading, Para, Table
from reports.interventions.patch_localisation import PLACES, has_positions, localisation

PLACE_WORDS = {
    "prefix": "class token",
    "replaced": "a replaced patch",
    "untouched": "an untouched patch",
}
DIRECTION_WORDS = {"denoising": "restored", "noising": "removed"}


def _band(cells, prefix, key, direction, place, conf):
    per_seed = {s: localisation(z, prefix, key, direction)[place] for s, z in cells.items()}
    return seed_band(per_seed, conf)


def places_blocks(
    arm: str, cells: dict[int, dict], protocol, level: int, prefix: int
) -> list[Block]:
    """Per block and direction: the class token, a replaced patch and an untouched patch."""
    spec, conf = protocol.patching, protocol.evaluation.confidence
    positions = has_positions(cells)
    blocks: list[Block] = [
        Heading(level, f"Where the corruption sits ({arm})"),
        Para(
            f"Each pair's corrupted image has {spec.replaced_patches} of its patches (positions drawn "
            "per pair) from the corrupting image, so a map by token position mixes pairs in which a "
            "position was replaced with pairs in which it was not. Here each pair is read at its own "
            "positions: the residual stream (`blocks.i.resid2`) patched at the class token, at a "
            "replaced patch (the mean over the pair's replaced positions) and at an untouched patch "
            "(the mean over the others), then the fraction of the logit difference restored "
            "(denoising) or removed (noising), a ratio of means over the pairs"
            + (
                "; likewise each branch and the block's largest single head patched at one position."
                if positions
                else "."
            )
            + f" Mean over seeds [{conf:.0%} t-interval over {len(cells)} seeds]."
        ),
    ]
    depth = next(iter(cells.values()))["resid_ld"].shape[1]
    keys = [("resid", None, "residual")]
    if positions:
        keys += [("branch_pos", 0, "attention branch"), ("branch_pos", 1, "MLP branch")]
        keys += [("head_pos", None, "largest head")]
    for direction in ("denoising", "noising"):
        rows = []
        for key, part, name in keys:
            bands = {p: _band(cells, prefix, key, direction, p, conf) for p in PLACES}
            for i in range(depth):
                at = (i,) if part is None else (i, part)
                rows.append(
                    [name, str(i)]
                    + [interval_cell(*(float(b[at]) for b in bands[p])) for p in PLACES]
                )
        blocks.append(
            Table(
                ["patched", "block"]
                + [
                    f"{direction}: {PLACE_WORDS[p]}, fraction {DIRECTION_WORDS[direction]}"
                    for p in PLACES
                ],
                rows,
                align=["l", "r", "r", "r", "r"],
            )
        )
    return blocks


def _largest_head_maps(cells: dict[int, dict], direction: str) -> dict[int, np.ndarray]:
    """Per seed, (depth, tokens): the largest single head's fraction at each position."""
    return {s: m.max(axis=1) for s, m in effect_maps(cells, "head_pos", direction).items()}


def positions_blocks(
    arm: str, cells: dict[int, dict], protocol, level: int, prefix: int
) -> list[Block]:
    """Maps blocks x positions for the attention branch, the MLP branch and the largest head."""
    if not has_positions(cells):
        return []
    conf = protocol.evaluation.confidence
    tokens = next(iter(cells.values()))["resid_ld"].shape[2]
    names = ["cls" if t < prefix else f"p{t - prefix}" for t in range(tokens)]
    blocks: list[Block] = [
        Heading(level, f"Branches and heads per position ({arm})"),
        Para(
            "Each branch output (`blocks.i.attn`, `blocks.i.mlp`) and each head's output "
            "(`blocks.i.attn.z`) patched at one token position at a time. Heads of separately "
            "trained seeds do not correspond by index, so per seed and position the block's largest "
            "single head is taken, then the mean over seeds. The table lists each block's three "
            f"largest positions with the {conf:.0%} t-interval over seeds."
        ),
    ]
    for direction in ("denoising", "noising"):
        branch = effect_maps(cells, "branch_pos", direction)  # (depth, 2, tokens) per seed
        maps = {
            "attention branch": {s: m[:, 0] for s, m in branch.items()},
            "MLP branch": {s: m[:, 1] for s, m in branch.items()},
            "largest head": _largest_head_maps(cells, direction),
        }
        means = {name: seed_band(per_seed, conf) for name, per_seed in maps.items()}
        word = DIRECTION_WORDS[direction]
        blocks.append(
            Figure(
                f"patching_{direction}_positions_{arm}.png",
                (
                    f"{direction.capitalize()}: fraction {word} when the attention branch, the MLP "
                    "branch or the block's largest head is patched at one token position (x: token "
                    "position, prefix tokens first, then the patches row by row); mean over seeds."
                ),
                heatmaps(
                    [(name, mean, "token position") for name, (mean, _, _) in means.items()],
                    f"{protocol.name}: {arm}, {direction}, one position patched",
                ),
            )
        )
        blocks.append(
            Figure(
                f"patching_{direction}_positions_patches_{arm}.png",
                (
                    f"The same maps without the prefix tokens, on a scale to their own largest value "
                    f"(x: patch, row by row): how much one patch position's branch or head {word}."
                ),
                heatmaps(
                    [(name, mean[:, prefix:], "patch") for name, (mean, _, _) in means.items()],
                    f"{protocol.name}: {arm}, {direction}, one patch position patched",
                    to_data=True,
                ),
            )
        )
        rows = []
        for name, (mean, lo, hi) in means.items():
            top = np.argsort(-np.nan_to_num(mean, nan=-np.inf), axis=1)[:, :3]
            for i in range(mean.shape[0]):
                rows.append(
                    [
                        name,
                        str(i),
                        "; ".join(
                            f"{names[t]} {interval_cell(mean[i, t], lo[i, t], hi[i, t])}"
                            for t in top[i]
                        ),
                    ]
                )
        blocks.append(
            Table(
                ["patched", "block", f"{direction}, largest positions: fraction {word} [interval]"],
                rows,
                align=["l", "r", "l"],
            )
        )
    return blocks
