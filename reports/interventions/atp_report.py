"""Attribution patching against exact patching: the section of an intervention report.

Per acted-on arm, from every cell's ``interventions/patching.npz`` where the cells ran
``patching.attribution_patching`` (``workbench.interventions.attribution_patching``): AtP and
AtP-IG, and the two controls (AtP with shuffled gradients, random scores), each scored against
the same cell's exact patches location by location (``agreement``: Spearman's rho over the
locations the readout reads, the overlap of the ten largest, the share with the same sign), per
seed and as a mean over seeds with its interval (rho: Student-t on Fisher's z,
``workbench.stats.fisher_z_interval``; the shares: Student-t, ``paired_seed_comparison`` against
0), AtP minus each control paired by seed; the locations where AtP differs most from exact
patching and how many of them sit at the class token; the passes each costs; and the maps
(exact, AtP, AtP-IG; AtP's split of each branch and head over the token positions).

Every number comes from the logged per-location arrays, so the section rebuilds from the
evidence export as the rest of the report does.
"""

from __future__ import annotations

import re

import numpy as np
from matplotlib.figure import Figure as MplFigure

from reports.figures import report_png
from reports.interventions.patching_report import heatmaps
from reports.render import Block, Figure, Heading, Para, Table
from workbench import stats
from workbench.interventions.attribution_patching import (
    CONTROL,
    ESTIMATES,
    agreement,
    location_fractions,
    random_agreement,
    read_locations,
)
from workbench.interventions.patching import DIRECTIONS
from reports.content.rounding import fmt

NAMES = {"atp": "AtP", "atp_ig": "AtP-IG", CONTROL: "AtP, shuffled gradients", "random": "random"}
MEASURES = ("rho", "top10_overlap", "sign_agreement")
MEASURE_NAMES = {"rho": "ρ", "top10_overlap": "top-10 overlap", "sign_agreement": "sign agreement"}
WORST = 10  # the locations where an estimate differs most: their class-token share
SHOWN_WORST = 5  # of which the table names these per seed
RESID = re.compile(r"blocks\.(\d+)\.resid2\[(\d+)\]$")


def has_atp(cells: dict[int, dict]) -> bool:
    """Whether every cell logged the AtP arrays and the controls (``estimate_split``'s)."""
    return bool(cells) and all("atp_resid_ld" in z and "random_scores" in z for z in cells.values())


def _shape(z: dict) -> tuple[int, int, int]:
    depth, tokens = z["resid_ld"].shape[1:]
    return depth, tokens, z["head_ld"].shape[2]


def kept(z: dict) -> np.ndarray:
    """The scored locations of one cell: every one but the residual positions never read."""
    depth, _, heads = _shape(z)
    return read_locations(z["resid_reads"], depth, heads)


def seed_scores(cells: dict[int, dict], direction: str) -> dict[str, dict[str, dict[int, float]]]:
    """``{estimate: {measure: {seed: value}}}`` for ``ESTIMATES`` and ``random`` (the mean over
    its draws), over each cell's kept locations."""
    out: dict = {m: {k: {} for k in MEASURES} for m in (*ESTIMATES, "random")}
    for seed, z in sorted(cells.items()):
        keep = kept(z)
        for m in ESTIMATES:
            for k, v in agreement(z, z, m, direction, keep).metrics().items():
                if k in MEASURES:
                    out[m][k][seed] = v
        draws = [a.metrics() for a in random_agreement(z, z["random_scores"], direction, keep)]
        for k in MEASURES:
            out["random"][k][seed] = float(np.mean([d[k] for d in draws]))
    return out


def mean_interval(values: dict[int, float], measure: str, confidence: float):
    """Mean over seeds and its interval: rho on Fisher's z; a share by Student-t, clipped to
    [0, 1] (with few seeds the t-interval of a share can pass either end)."""
    mean = float(np.mean(list(values.values())))
    if measure == "rho":
        return mean, *stats.fisher_z_interval(list(values.values()), confidence)
    c = stats.paired_seed_comparison(values, dict.fromkeys(values, 0.0), confidence)
    return mean, max(c.ci_low, 0.0), min(c.ci_high, 1.0)


def _band(mean: float, low: float, high: float, d: int = 2, signed: bool = False) -> str:
    band = f" [{fmt(low, d, signed)}, {fmt(high, d, signed)}]" if np.isfinite(low) else ""
    return f"{fmt(mean, d, signed)}{band}"


def position_name(t: int, prefix: int) -> str:
    return "cls" if t == 0 and prefix >= 1 else (f"r{t}" if t < prefix else f"p{t - prefix}")


def shown_location(name: str, prefix: int) -> str:
    """``blocks.2.resid2[0]`` as ``blocks.2.resid2 at cls``; branches and heads as named."""
    m = RESID.match(name)
    return f"blocks.{m[1]}.resid2 at {position_name(int(m[2]), prefix)}" if m else name


def at_class_token(name: str) -> bool:
    m = RESID.match(name)
    return m is not None and int(m[2]) == 0


def worst_locations(cells: dict[int, dict], method: str, direction: str = "denoising"):
    """Per seed, ``agreement``'s ``WORST`` locations of largest |estimate - exact|."""
    return {
        s: agreement(z, z, method, direction, kept(z), worst=WORST).worst
        for s, z in sorted(cells.items())
    }


def class_token_share(worst: dict) -> dict[int, float]:
    """Per seed, the share of the worst locations that are the class token's residual."""
    return {s: float(np.mean([at_class_token(n) for n, _, _ in w])) for s, w in worst.items()}


def scored_class_token_share(z: dict) -> float:
    """The share of one cell's scored locations that are the class token's residual."""
    depth, tokens, heads = _shape(z)
    keep = kept(z)
    cls = np.zeros_like(keep)
    cls[np.arange(depth) * tokens] = True  # blocks.i.resid2[0]
    return float((cls & keep).sum() / keep.sum())


def _scores_table(scores: dict, confidence: float, seeds: list[int], direction: str) -> Table:
    rows = []
    for m in (*ESTIMATES, "random"):
        per = scores[m]["rho"]
        rows.append(
            [NAMES[m], " / ".join(fmt(per[s], 2, True) for s in seeds)]
            + [
                _band(*mean_interval(scores[m][k], k, confidence), signed=k == "rho")
                for k in MEASURES
            ]
        )
    what = "restored" if direction == "denoising" else "removed"
    return Table(
        ["estimate", "ρ per seed", "mean ρ", "top-10 overlap", "sign agreement"],
        rows,
        ["l", "r", "r", "r", "r"],
        [
            f"Each estimate of the fraction {what} against the exact one, location by location "
            f"in each cell; per seed in seed order ({', '.join(map(str, seeds))}); mean over "
            f"seeds with its {confidence:.0%} interval (ρ: Student-t on Fisher's z; the shares: "
            "Student-t, clipped to [0, 1]). random: the mean over its draws in each cell."
        ],
    )


def _paired_rows(scores: dict, direction: str, confidence: float) -> list[list[str]]:
    rows = []
    for a, b in (("atp", CONTROL), ("atp", "random"), ("atp_ig", "atp")):
        for k in MEASURES:
            c = stats.paired_seed_comparison(scores[a][k], scores[b][k], confidence)
            rows.append(
                [
                    direction,
                    f"{NAMES[a]} − {NAMES[b]}",
                    MEASURE_NAMES[k],
                    _band(c.mean_difference, c.ci_low, c.ci_high, signed=True),
                    f"{c.wins} of {c.n}",
                ]
            )
    return rows


def _worst_blocks(cells: dict[int, dict], prefix: int, confidence: float) -> list[Block]:
    worst = {m: worst_locations(cells, m) for m in ("atp", "atp_ig")}
    shares = {m: class_token_share(w) for m, w in worst.items()}
    base = {s: scored_class_token_share(z) for s, z in sorted(cells.items())}
    rows = [
        [
            str(s),
            str(i + 1),
            f"`{shown_location(n, prefix)}`",
            fmt(e, 3, True),
            fmt(a, 3, True),
            fmt(a - e, 3, True),
        ]
        for s, w in worst["atp"].items()
        for i, (n, e, a) in enumerate(w[:SHOWN_WORST])
    ]
    share_rows = [
        [
            NAMES[m],
            " / ".join(fmt(v, 2) for v in shares[m].values()),
            _band(*mean_interval(shares[m], "share", confidence)),
        ]
        for m in ("atp", "atp_ig")
    ] + [
        [
            "(class token among the scored locations)",
            " / ".join(fmt(v, 3) for v in base.values()),
            _band(*mean_interval(base, "share", confidence), d=3),
        ]
    ]
    return [
        Table(
            ["seed", "rank", "location", "exact", "AtP", "AtP − exact"],
            rows,
            ["r", "r", "l", "r", "r", "r"],
            [
                f"Denoising, fraction restored. The {SHOWN_WORST} locations of each seed where AtP "
                "differs most from exact patching (largest |AtP − exact|), largest first; "
                "`resid2 at cls`: the class token's residual after that block, `pK`: patch K (row "
                "by row)."
            ],
        ),
        Table(
            [f"share of the {WORST} worst locations at the class token", "per seed", "mean"],
            share_rows,
            ["l", "r", "r"],
            [
                f"The {WORST} locations of largest |estimate − exact| per seed that are the class "
                "token's residual; beside it the share the class token's residuals have among the "
                f"scored locations (what the worst would hold by chance). Brackets: {confidence:.0%} "
                "t-interval over seeds, clipped to [0, 1]."
            ],
        ),
    ]


def _cost_table(cells: dict[int, dict]) -> Table:
    rows = []
    first = next(iter(cells.values()))
    exact = first["exact_passes"].astype(int)
    for m, name in (("exact", "exact patching"), *((m, NAMES[m]) for m in ESTIMATES)):
        f, b = (int(v) for v in first[f"{m}_passes"])
        seconds = np.mean([float(z[f"{m}_seconds"]) for z in cells.values()])
        rows.append(
            [
                name,
                str(f),
                str(b),
                str(f + b),
                fmt(exact.sum() / (f + b), 1),
                f"{fmt(seconds, 2)} s",
            ]
        )
    return Table(
        ["", "forwards", "backwards", "forwards + backwards", "exact ÷ this", "wall time per cell"],
        rows,
        ["l", "r", "r", "r", "r", "r"],
        [
            "Passes per batch of pairs, both directions, as counted at the classifier in the "
            "tests; exact patching's are all but two partial forwards (from the patched block on), "
            "counted whole. Wall time: mean over the cells of each method on the whole sample "
            "(exact patching's includes finding the positions the readout reads), on whatever "
            "machine ran them."
        ],
    )


def _mean_fractions(cells: dict[int, dict], method: str) -> dict[str, np.ndarray]:
    """Mean over seeds of the denoising fractions of each kind (``resid``, ``branch``, ``head``)."""
    flat = np.mean([location_fractions(z, method) for z in cells.values()], axis=0)
    depth, tokens, heads = _shape(next(iter(cells.values())))
    r, b = depth * tokens, depth * 2
    return {
        "resid": flat[:r].reshape(depth, tokens),
        "branch": flat[r : r + b].reshape(depth, 2),
        "head": flat[r + b :].reshape(depth, heads),
    }


def _position_maps(z: dict, method: str, kind: str) -> np.ndarray:
    """(depth, 2 or heads, tokens) one cell's AtP change per position as a fraction restored."""
    gap = float(
        np.mean(z["clean_ld"], dtype=np.float64) - np.mean(z["corrupted_ld"], dtype=np.float64)
    )
    return z[f"{method}_position_{kind}_change"].astype(np.float64) / gap


def _patch_grid_panel(
    ax, values: np.ndarray, grid: tuple[int, int], prefix: int, lim: float, title: str
):  # the prefix tokens' values in the title, the patches on the colour scale
    im = ax.imshow(values[prefix:].reshape(grid), cmap="RdBu_r", vmin=-lim, vmax=lim)
    ax.set_title(f"{title}\ncls {fmt(float(values[0]), 3, True)}" if prefix else title, fontsize=7)
    ax.set_xticks([])
    ax.set_yticks([])
    return im


def _grid_figure(
    panels: list[list[tuple[str, np.ndarray]]], grid, prefix: int, title: str
) -> bytes:
    rows, cols = len(panels), len(panels[0])
    fig = MplFigure(figsize=(1.7 * cols + 0.8, 1.8 * rows + 0.8))
    axes = fig.subplots(rows, cols, squeeze=False)
    # the colour scale is the patches' (the prefix tokens' values, often far larger, are titled)
    values = np.concatenate([v[prefix:].ravel() for row in panels for _, v in row])
    lim = float(np.nanmax(np.abs(values))) or 1.0
    im = None
    for r, row in enumerate(panels):
        for c, (name, v) in enumerate(row):
            im = _patch_grid_panel(axes[r][c], v, grid, prefix, lim, name)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6)
    fig.suptitle(title, fontsize=9)
    return report_png(fig)


def _figures(arm: str, cells: dict[int, dict], protocol, prefix: int, grid) -> list[Block]:
    name = protocol.name
    maps = {m: _mean_fractions(cells, m) for m in ("", "atp", "atp_ig")}
    labels = {"": "exact", "atp": "AtP", "atp_ig": "AtP-IG"}
    out = [
        Figure(
            f"atp_resid_{arm}.png",
            "Fraction restored when block i's output at one token position is patched from the "
            "clean run (denoising), mean over seeds: exact patching, AtP's estimate and AtP-IG's, "
            "on one colour scale (x: token position, prefix tokens first).",
            heatmaps(
                [(labels[m], maps[m]["resid"], "token position") for m in maps],
                f"{name}: {arm}, residual stream: exact and estimated",
            ),
        ),
        Figure(
            f"atp_heads_branches_{arm}.png",
            "Fraction restored when one branch (columns attn, mlp) or one head (h0, h1, ...) is "
            "patched, mean over seeds: exact, AtP, AtP-IG. Heads of separately trained seeds do "
            "not correspond by index: read a row as what a head of that block carries.",
            heatmaps(
                [
                    (
                        labels[m],
                        np.concatenate([maps[m]["branch"], maps[m]["head"]], axis=1),
                        "attn, mlp, heads",
                    )
                    for m in maps
                ],
                f"{name}: {arm}, branches and heads: exact and estimated",
                ["attn", "mlp", *(f"h{h}" for h in range(maps[""]["head"].shape[1]))],
            ),
        ),
    ]
    if grid is None:
        return out
    depth = maps[""]["resid"].shape[0]
    branch = {
        m: np.mean([_position_maps(z, m, "branch") for z in cells.values()], axis=0)
        for m in ("atp", "atp_ig")
    }
    panels = [
        [
            (f"block {i} {k} ({labels[m]})", branch[m][i, j])
            for m in ("atp", "atp_ig")
            for j, k in enumerate(("attn", "mlp"))
        ]
        for i in range(depth)
    ]
    out.append(
        Figure(
            f"atp_branch_positions_{arm}.png",
            "Where on the image each branch's restoring happens, by AtP and AtP-IG: the estimate "
            "of patching the branch's output split over the token positions it is the sum of "
            "(the patch grid, with the class token's share in the title: the colour scale is the "
            "patches'), as a fraction restored, mean over seeds. Exact patching patches a branch at every position at once, so it "
            "has no such map.",
            _grid_figure(
                panels, grid, prefix, f"{name}: {arm}, branches by position (AtP, AtP-IG)"
            ),
        )
    )
    heads = []
    for s, z in sorted(cells.items()):
        per = _position_maps(z, "atp", "head")
        heads += [
            [(f"seed {s} block {i} h{h}", per[i, h]) for h in range(per.shape[1])]
            for i in range(depth)
        ]
    out.append(
        Figure(
            f"atp_head_positions_{arm}.png",
            "Each head's AtP estimate split over the token positions (fraction restored, the "
            "patch grid on the patches' colour scale; the class token's in the title), per seed: heads of separately trained "
            "seeds do not correspond by index, so they are not averaged.",
            _grid_figure(heads, grid, prefix, f"{name}: {arm}, heads by position (AtP)"),
        )
    )
    return out


def atp_results(arm: str, cells: dict[int, dict], confidence: float) -> list[Block]:
    """The Results paragraph: each estimate's mean rho against exact patching, per direction."""
    if not has_atp(cells):
        return []
    parts = []
    for direction in DIRECTIONS:
        scores = seed_scores(cells, direction)
        shown = ", ".join(
            f"{NAMES[m]} {_band(*mean_interval(scores[m]['rho'], 'rho', confidence), signed=True)}"
            for m in (*ESTIMATES, "random")
        )
        parts.append(f"{direction}: {shown}")
    return [
        Para(
            f"**{arm}**, attribution patching against exact patching, Spearman ρ over the "
            f"locations (mean over {len(cells)} seeds, {confidence:.0%} interval): "
            + "; ".join(parts)
            + "."
        )
    ]


def atp_blocks(
    arm: str, cells: dict[int, dict], protocol, level: int, prefix: int, grid
) -> list[Block]:
    """The section for one arm; ``cells`` maps each seed to its ``patching.npz`` arrays.

    Args:
        prefix: The model's prefix tokens (class token first).
        grid: (rows, cols) of the patch grid, for the per-position figures; None: none drawn.
    """
    if not has_atp(cells):
        return []
    conf, seeds = protocol.evaluation.confidence, sorted(cells)
    spec = protocol.patching
    first = next(iter(cells.values()))
    scored = int(kept(first).sum())
    blocks: list[Block] = [
        Heading(level, f"Attribution patching against exact patching ({arm})"),
        Para(
            "Attribution patching (AtP; Nanda 2023, Syed et al. 2023) estimates every patch of the "
            "grid above from one forward and backward of each run: the target run's logit "
            "difference plus (source activation − target activation) · its gradient. AtP-IG "
            f"averages the gradient over {spec.ig_steps} points of the straight line from the "
            "target run to the source, drawn at the embedding (Hanna et al. 2024). Each is scored "
            "against the same cell's exact patches on the fraction restored (denoising) or "
            f"removed (noising), over the {scored} locations whose patch the readout can feel "
            "(every block x position residual it reads, every branch and head): Spearman's ρ, the "
            "share of the ten locations of largest |exact| among the ten of largest |estimate| "
            "(top-10 overlap), and the share with the same sign. Controls, scored the same way: "
            "AtP with each hook site's gradients shuffled over the pairs and positions (a "
            "location's own activation difference with another pair's gradient at another place) "
            f"and {first['random_scores'].shape[0]} draws of random scores per location (their "
            f"mean). Brackets: {conf:.0%} interval over {len(cells)} seeds (ρ: Student-t on "
            "Fisher's z; the shares: Student-t)."
        ),
    ]
    for direction in DIRECTIONS:
        scores = seed_scores(cells, direction)
        blocks += [
            Heading(level + 1, f"AtP against exact patching, {direction} ({arm})"),
            _scores_table(scores, conf, seeds, direction),
            Table(
                ["direction", "difference", "measure", "mean [interval]", "higher in"],
                _paired_rows(scores, direction, conf),
                ["l", "l", "l", "r", "r"],
                [
                    f"Paired by seed: mean difference, {conf:.0%} Student-t interval over seeds, seeds where it is positive."
                ],
            ),
        ]
    blocks += [Heading(level + 1, f"Where AtP fails most ({arm})")] + _worst_blocks(
        cells, prefix, conf
    )
    blocks += [Heading(level + 1, f"Cost ({arm})"), _cost_table(cells)]
    blocks += _figures(arm, cells, protocol, prefix, grid)
    return blocks
