"""The edge-patching part of an intervention report (cells run with ``patching.edges``).

Per acted-on arm, from every cell's ``patching.npz`` (``workbench.interventions.edge_patching``):
each edge's fraction of the clean-vs-corrupted logit difference restored, by exact path patching
and by edge AtP, and how far the estimate agrees with the exact edges per seed (Spearman rho,
sign agreement, top-10 overlap over the edges) with the mean over seeds and its interval (rho on
Fisher's z). Heads do not correspond across seeds, so edges are compared within a seed and a
reader's edges are summarised by the head that restores most into it in each seed.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure as MplFigure

from reports.figures import report_png
from reports.interventions.atp_report import mean_interval
from reports.render import Block, Figure, Heading, Para, Table
from workbench import stats
from workbench.interventions.edge_patching import edge_agreement
from reports.content.rounding import fmt

MEASURES = (
    ("edges_rho", "rho", "Spearman rho"),
    ("edges_sign_agreement", "share", "same sign"),
    ("edges_top10_overlap", "share", "top-10 overlap"),
)


def has_edges(cells: dict[int, dict]) -> bool:
    return bool(cells) and all("edge_exact_ld" in z for z in cells.values())


def restored(z: dict, key: str) -> np.ndarray:
    """Per edge, the fraction restored: the mean change over pairs over the mean gap."""
    gap = float(
        np.mean(z["clean_ld"], dtype=np.float64) - np.mean(z["corrupted_ld"], dtype=np.float64)
    )
    return z[key].astype(np.float64).mean(axis=0) / gap


def seed_agreement(cells: dict[int, dict]) -> dict[str, dict[int, float]]:
    """Per measure (``edges_rho``, ...), its value in each seed."""
    per = {s: edge_agreement(z) for s, z in sorted(cells.items())}
    return {key: {s: a[key] for s, a in per.items()} for key, _, _ in MEASURES}


def _band(values: dict[int, float], measure: str, conf: float, signed: bool = False) -> str:
    mean, low, high = mean_interval(values, measure, conf)
    band = f" [{fmt(low, 2, signed)}, {fmt(high, 2, signed)}]" if np.isfinite(low) else ""
    return f"{fmt(mean, 2, signed)}{band}"


def _readers(labels: np.ndarray) -> list[tuple[int, str]]:
    """(sender block, reader) pairs in the edges' order, each once."""
    seen = []
    for label in labels:
        sender, reader = str(label).split("->")
        key = (int(sender[1 : sender.index("H")]), reader)
        if key not in seen:
            seen.append(key)
    return seen


def scatter(cells: dict[int, dict], title: str) -> bytes:
    fig = MplFigure(figsize=(4.6, 4.2))
    ax = fig.subplots()
    for s, z in sorted(cells.items()):
        ax.scatter(
            restored(z, "edge_exact_ld"), restored(z, "edge_atp_ld"), s=12, label=f"seed {s}"
        )
    lo = min(ax.get_xlim()[0], ax.get_ylim()[0])
    hi = max(ax.get_xlim()[1], ax.get_ylim()[1])
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("exact path patching: fraction restored")
    ax.set_ylabel("edge AtP: fraction restored")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return report_png(fig)


def edge_blocks(arm: str, cells: dict[int, dict], protocol, level: int) -> list[Block]:
    """The section for one arm; ``cells`` maps each seed to its ``patching.npz`` arrays."""
    if not has_edges(cells):
        return []
    conf = protocol.evaluation.confidence
    first = next(iter(cells.values()))
    labels = first["edge_labels"]
    passes = first["edge_passes"].tolist()
    seconds = [float(z["edge_seconds"]) for z in cells.values()]
    agree = seed_agreement(cells)
    blocks: list[Block] = [
        Heading(level, f"Edges: heads into the class token's readers ({arm})"),
        Para(
            f"{len(labels)} edges: each head into each later reader of the class token's residual "
            "(the same block's MLP branch, each later block's attention and MLP branch, the "
            "readout). Exact path patching moves only that reader's input at the class token by "
            "the head's clean-minus-corrupted write, in the corrupted run; edge AtP estimates the "
            "change as the gradient at the reader's input times that write. Both as the fraction "
            "of the logit difference restored. Per pair batch: exact "
            f"{passes[0]} forwards; AtP {passes[1]} forwards and {passes[2]} backward. Wall time "
            f"of both per cell: {min(seconds):.1f} to {max(seconds):.1f} s. Brackets: {conf:.0%} "
            f"interval over {len(cells)} seeds (rho: Fisher's z)."
        ),
        Table(
            ["seed"] + [name for _, _, name in MEASURES],
            [[str(s)] + [fmt(agree[key][s], 2) for key, _, _ in MEASURES] for s in sorted(cells)]
            + [["mean"] + [_band(agree[key], kind, conf) for key, kind, _ in MEASURES]],
            align=["l", "r", "r", "r"],
        ),
        Figure(
            f"edges_{arm}.png",
            "Each edge's fraction restored, exact path patching (x) against edge AtP (y), every "
            "seed; the dashed line is equality.",
            scatter(cells, f"{protocol.name}: {arm}, edges"),
        ),
    ]
    rows = []
    for block, reader in _readers(labels):
        idx = [
            k
            for k, lab in enumerate(labels)
            if str(lab).startswith(f"L{block}H") and str(lab).endswith(f"->{reader}")
        ]
        best_exact, its_atp = {}, {}
        for s, z in cells.items():
            exact, atp = restored(z, "edge_exact_ld")[idx], restored(z, "edge_atp_ld")[idx]
            k = int(np.argmax(exact))
            best_exact[s], its_atp[s] = float(exact[k]), float(atp[k])
        rows.append(
            [
                f"block {block} head",
                reader,
                _t_band(best_exact, conf),
                _t_band(its_atp, conf),
            ]
        )
    blocks.append(
        Table(
            ["sender", "reader", "largest head, exact: fraction restored", "its edge AtP"],
            rows,
            align=["l", "l", "r", "r"],
        )
    )
    return blocks


def _t_band(values: dict[int, float], conf: float) -> str:
    """Mean over seeds [Student-t interval], unclipped: a fraction restored can leave [0, 1]."""
    c = stats.paired_seed_comparison(values, dict.fromkeys(values, 0.0), conf)
    band = f" [{fmt(c.ci_low, 2)}, {fmt(c.ci_high, 2)}]" if np.isfinite(c.ci_low) else ""
    return f"{fmt(c.mean_difference, 2)}{band}"
