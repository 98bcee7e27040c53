"""The report of an intervention protocol: same pipeline, files and logging as the other kinds.

Per acted-on arm: the block x head heatmap of the mean accuracy change (``*`` where the
t-interval over seeds excludes zero), the ranked table (mean change, t-interval, bootstrap
over seeds and examples, in how many seeds accuracy fell), the branch bars, the seeds'
agreement on head importance (Spearman), and each head's mean attention map beside its
effect. Numbers come from ``workbench.interventions.summary`` over the per-example outcomes
every cell logged; the results paragraphs from ``reports.content.intervention_wording``.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from reports import provenance
from reports.common.report_parts import (
    ActedReport,
    ActedBlocks,
    SPLIT_WORDS,
    acted_on_table,
)
from reports.figures import report_png
from reports.interventions import intervention_evidence
from reports.interventions.atp_report import atp_blocks, atp_results
from reports.interventions.evaluated_images import scored_blocks
from reports.interventions.edge_report import edge_blocks
from reports.interventions.patch_places_report import places_blocks, positions_blocks
from reports.interventions.patching_report import patching_blocks
from reports.interventions.intervention_study import InterventionReadout
from reports.output import paired_metrics
from reports.interventions.patch_localisation import has_places
from reports.render import Block, Figure, Heading, Para, Quote, Table
from tracking.kinds import intervention_runs
from tracking.record import queries
from workbench.analysis import intervention_figures
from workbench.interventions.spec import HeadAblation
from workbench.interventions.summary import (
    CellOutcomes,
    InterventionRow,
    head_matrix,
    ranked,
    seed_consistency,
    summarize,
)
from workbench.protocol import InterventionProtocol
from reports.content.intervention_wording import (
    effect_caveats,
    effect_paragraph,
    heads_sentence,
)
from reports.content.rounding import bootstrap_display, exact_decimals, fmt

# What reports.common.report_parts.ActedReport reads: the readout, the export, the summary's numbers.
READOUT = InterventionReadout
EVIDENCE = intervention_evidence
TOP_EFFECTS = 3  # results paragraphs for the largest drops
DIFFERENCES = "accuracy changes in percentage points (intervened minus intact)"


def _t(row: InterventionRow) -> str:
    c = row.paired
    if not (math.isfinite(c.ci_low) and math.isfinite(c.ci_high)):
        return "n/a"
    text = f"[{fmt(c.ci_low * 100, 2, True)}, {fmt(c.ci_high * 100, 2, True)}]"
    return text + ("*" if row.excludes_zero("t") else "")


def _boot(row: InterventionRow) -> str:
    shown = bootstrap_display(row.bootstrap, 100.0, "points")
    return f"[{shown.low}, {shown.high}]"


def ranked_table(rows: list[InterventionRow], confidence: float, n_resamples: int) -> Table:
    # Per-seed changes are multiples of 100 / images (0.125 points on 800): shown exactly, as few decimals as that takes.
    d = exact_decimals([x * 100 for r in rows for x in r.paired.differences], 2, 3)
    body = [
        [
            str(i + 1),
            f"`{r.name}`",
            fmt(r.paired.mean_difference * 100, d, True),
            _t(r),
            _boot(r),
            f"{r.lower_in} of {r.paired.n}",
            " / ".join(fmt(x * 100, d, True) for x in r.paired.differences),
        ]
        for i, r in enumerate(ranked(rows))
    ]
    return Table(
        [
            "rank",
            "intervention",
            "mean change, points",
            f"{confidence:.0%} t-interval",
            f"{confidence:.0%} bootstrap",
            "lower in",
            "change per seed",
        ],
        body,
        ["r", "l", "r", "r", "r", "r", "r"],
        [
            f"Change = accuracy with the intervention minus the intact model's, same cell and images, in points; "
            "largest drop first. t-interval: Student-t over seeds (df = n − 1), * where it excludes zero (never for a "
            "zero-width interval); "
            f"bootstrap: hierarchical over seeds, then images ({n_resamples:,} resamples), endpoints to the "
            "decimals their Monte-Carlo error supports. 'lower in': seeds where the intervention lowered "
            "accuracy. Per seed in seed order."
        ],
        css_class="wide",
    )


def seed_head_changes(
    rows: list[InterventionRow], mode: str, depth: int, heads: int
) -> dict[int, np.ndarray]:
    """Seed -> ``(depth, heads)`` accuracy change (fraction) of each head ablated in ``mode`` in that seed's model.

    The heads of separately trained seeds do not correspond by index (a block's heads are
    interchangeable at initialisation), so these per-seed matrices, not their mean, show
    each model's heads.
    """
    head_rows = [
        r
        for r in rows
        if isinstance(r.item, HeadAblation)
        and r.item.mode == mode
        and r.item.block < depth
        and r.item.head < heads
    ]
    out: dict[int, np.ndarray] = {}
    for seed in sorted(head_rows[0].intact) if head_rows else []:
        change = np.full((depth, heads), np.nan)
        for r in head_rows:
            change[r.item.block, r.item.head] = r.intervened[seed] - r.intact[seed]
        out[seed] = change
    return out


def consistency_table(rows: list[InterventionRow], modes: list[str]) -> list[Block]:
    body = []
    for mode in modes:
        pairs = seed_consistency(rows, mode)
        rhos = [p.rho for p in pairs if math.isfinite(p.rho)]
        if not pairs:
            continue
        body.append(
            [
                f"{mode}-ablated heads",
                str(len(pairs)),
                f"{np.mean(rhos):+.2f}" if rhos else "n/a",
                f"{min(rhos):+.2f}" if rhos else "n/a",
                f"{max(rhos):+.2f}" if rhos else "n/a",
                str(len(pairs) - len(rhos)),
            ]
        )
    if not body:
        return [Para("Seed consistency needs at least two seeds and three heads.")]
    return [
        Table(
            ["heads", "seed pairs", "mean ρ", "min ρ", "max ρ", "pairs without spread"],
            body,
            ["l", "r", "r", "r", "r", "r"],
            [
                "Spearman rank correlation of the heads' accuracy changes between every two seeds, head by index: +1 "
                "when two seeds rank the heads' importance alike, 0 when unrelated. Separately trained seeds have "
                "no reason to put an important head at the same index (a block's heads are interchangeable at "
                "initialisation), so ρ near 0 is what index-free importance predicts; what the seeds share shows "
                "in the per-block means and in the per-seed counts under Results. A pair where one seed's changes "
                "are all equal has no ranking (counted, not averaged)."
            ],
        )
    ]


def arm_blocks(
    arm: str,
    rows: list[InterventionRow],
    cells: dict[int, intervention_runs.InterventionCellResult],
    protocol: InterventionProtocol,
    depth: int,
    heads: int,
    level: int,
    n_resamples: int,
) -> list[Block]:
    """Every table and figure of one acted-on arm."""
    e, h = protocol.evaluation, level
    modes = [
        m
        for m in ("zero", "mean")
        if any(isinstance(r.item, HeadAblation) and r.item.mode == m for r in rows)
    ]
    blocks: list[Block] = []
    if modes:
        matrices = {m: head_matrix(rows, m, depth, heads) for m in modes}
        blocks += [
            Heading(h, f"Heads ({arm})"),
            Figure(
                f"heads_{arm}.png",
                (
                    "Mean accuracy change (points) when one head is ablated, block x head, over seeds; * where the 95% "
                    "t-interval over seeds excludes zero (a zero-width interval, the same change in every seed, is no spread, not "
                    "certainty, and is not marked). Blue: accuracy rises, red: it falls. Heads of separately trained seeds do "
                    "not correspond by index: a square is the mean over seeds of whichever head each model has there, so it "
                    "says how much a head of that block costs, not that one particular head matters."
                ),
                report_png(
                    intervention_figures.heads_heatmap(
                        matrices, f"{protocol.name}: {arm}, one head ablated at a time"
                    )
                ),
            ),
        ]
    if not rows:  # a patching-only protocol: no intervention grid, nothing to rank
        return blocks
    blocks += [
        Heading(h, f"Every intervention, ranked ({arm})"),
        ranked_table(rows, e.confidence, n_resamples),
    ]
    others = [r for r in rows if not isinstance(r.item, HeadAblation)]
    if others:
        blocks += [
            Heading(h, f"Branches, positions and tokens ({arm})"),
            Figure(
                f"branches_{arm}.png",
                (
                    "Mean accuracy change per intervention (bar), 95% t-interval over seeds (thick line), 95% hierarchical "
                    "bootstrap (thin line), each seed (dots)."
                ),
                report_png(intervention_figures.effect_bars(others, f"{protocol.name}: {arm}")),
            ),
        ]
    blocks += [Heading(h, f"Seed consistency ({arm})")] + consistency_table(rows, modes)
    maps = {seed: c.attention for seed, c in cells.items() if c.attention is not None}
    if maps and "zero" in modes:
        changes = seed_head_changes(rows, "zero", depth, heads)
        blocks += [
            Heading(h, f"Attention maps beside the effects ({arm})"),
            Figure(
                f"attention_{arm}.png",
                (
                    "Each head's mean attention map on the evaluation images in each seed's model (one row per seed and block), "
                    "titled with the accuracy change when that head alone is zero-ablated in that model: whether the heads "
                    "whose attention looks focused are the ones that matter. Per seed, not averaged: heads of separately "
                    "trained seeds do not correspond by index. Attention shows where information flowed, not why the model "
                    "predicted what it did."
                ),
                report_png(
                    intervention_figures.attention_beside_effects(
                        {s: maps[s] for s in changes if s in maps},
                        changes,
                        next(iter(cells.values())).attention_query,
                        f"{protocol.name}: {arm}",
                    )
                ),
            ),
        ]
    return blocks


def build_blocks(
    study: InterventionReadout,
    inputs: provenance.BuildInputs,
    log_targets: list[str],
    n_resamples: int,
) -> tuple[list[Block], list[str], list[str], int, dict[str, float]]:
    """The report's blocks, its warnings, what ``--strict`` refuses, the number of reported cells, and every
    intervention's comparison with the intact model as ``cmp.<arm>.<intervention>_vs_intact.<split>.*`` metrics."""
    protocol, built = study.protocol, ActedBlocks(study)
    e = protocol.evaluation
    split = SPLIT_WORDS[e.split]
    for arm, cells in built.reported_arms():
        outcomes = {
            s: CellOutcomes(c.names, c.labels, c.intact_predicted, c.predicted)
            for s, c in cells.items()
        }
        rows = summarize(outcomes, n_resamples, e.confidence, e.seed)
        for r in rows:
            built.metrics |= paired_metrics(
                f"{arm}.{r.name}", "intact", e.split, r.paired, r.bootstrap
            )
        depth, heads = _shape(protocol, arm, cells)
        accuracies = [100 * o.accuracy() for o in outcomes.values()]
        intact = ", ".join(fmt(a, exact_decimals(accuracies, 2, 3)) for a in accuracies)
        built.results.append(
            Para(
                f"**{arm}**: intact {split} accuracy {intact} % (seeds {', '.join(map(str, cells))}); "
                f"{len(rows)} interventions, each applied on its own to every cell."
            )
        )
        built.results += [
            Para(t) for t in (heads_sentence(rows, m, split) for m in ("zero", "mean")) if t
        ]
        top = ranked(rows)[:TOP_EFFECTS]
        built.results += [Quote(effect_paragraph(r, split)) for r in top]
        built.results += [Para(t) for t in [effect_caveats(top, split)] if t]
        built.sections += arm_blocks(arm, rows, cells, protocol, depth, heads, 2, n_resamples)
        if protocol.patching is not None:
            patched = {s: c.patching for s, c in cells.items() if c.patching is not None}
            prefix = protocol.model_config(arm).num_prefix_tokens if protocol.acts_on else 1
            built.sections += patching_blocks(arm, patched, protocol, 2, prefix)
            if has_places(patched):
                built.sections += places_blocks(arm, patched, protocol, 3, prefix)
            built.sections += positions_blocks(arm, patched, protocol, 3, prefix)
            built.sections += edge_blocks(arm, patched, protocol, 3)
            grid = tuple(protocol.model_config(arm).grid) if protocol.acts_on else None
            built.sections += atp_blocks(arm, patched, protocol, 2, prefix, grid)
            built.results += atp_results(arm, patched, e.confidence)
    sample, thin = scored_blocks(protocol, list(built.reported_arms()))
    blocks, warnings, refused, n, metrics = built.finish(
        inputs,
        log_targets,
        acted_on_blocks,
        what="Intervention",
        settings=f"evaluated on the {split} split; mean ablation over {e.mean_images:,} training "
        f"images (seed {e.mean_seed}).",
        after_header=sample,
    )
    # images too thin for the data are refused by --strict, as a missing cell is
    thin = [f"sample: {t}" for t in thin]
    return blocks, warnings + thin, refused + thin, n, metrics


def acted_on_blocks(rows: list[tuple[str, int, queries.CellRecord]]) -> list[Block]:
    """Which weights each cell acted on, its reload proof, and how long its interventions took."""
    return acted_on_table(
        rows,
        ["interventions", "images", "evaluation"],
        lambda m: [
            f"{int(m.get('interventions', 0))}",
            f"{int(m.get('examples', 0)):,}",
            f"{m.get('evaluation_seconds', math.nan):.1f} s",
        ],
        "Trained run: the finished cell whose best checkpoint was loaded; before any intervention it had to reproduce "
        "that run's saved validation predictions (bitwise on CPU). Evaluation: wall time of the intact pass, every "
        "intervention and the attention maps.",
    )


def _shape(
    protocol: InterventionProtocol,
    arm: str,
    cells: dict[int, intervention_runs.InterventionCellResult],
) -> tuple[int, int]:
    """(depth, heads) of the arm's model: from its config, or from the logged attention maps (pretrained)."""
    if protocol.acts_on is not None:
        cfg = protocol.model_config(arm)
        return cfg.depth, cfg.heads
    maps = next((c.attention for c in cells.values() if c.attention is not None), None)
    if maps is not None:
        return maps.shape[0], maps.shape[1]
    items = [HeadAblation(0, 0)] + [
        r for r in map(_parse_head, next(iter(cells.values())).names) if r is not None
    ]
    return max(i.block for i in items) + 1, max(i.head for i in items) + 1


def _parse_head(name: str) -> HeadAblation | None:
    from workbench.interventions.spec import parse

    item = None if name.startswith("set.") else parse(name)
    return item if isinstance(item, HeadAblation) else None


# This kind's report builder, which the table of kinds names.
REPORT = ActedReport(sys.modules[__name__])
