"""The ablation report's results: stated conclusions, the comparison tables, the forest plot.

Every comparison goes through ``reports.content.comparison.comparison_content``
once, so the paragraph, the per-seed differences, the effect size, the bootstrap display and
the forest-plot row come from the same numbers. Displayed per-seed values use the decimals
``display_decimals`` picks for the split (the fewest that show every value exactly, 2 or 3),
and the accuracy table uses the same, so each displayed difference is the difference of
displayed values. Interactions asked for with ``--interaction`` (``interaction_blocks``) go
through ``reports.content.interaction`` the same way, at the end of each split.
"""

from __future__ import annotations

import math
from dataclasses import replace

from reports import tables
from reports.collect import StudyData
from reports.render import Block, Figure, Heading, Para, Quote, Table
from reports.tables import ArmSummary, Comparison
from reports.content import comparison, forest, interaction
from workbench.estimates import bootstrap_seed_multisets, min_wilcoxon_p
from reports.content.rounding import exact_decimals, fmt, paired_display
from reports.content.wording import section_caveats

SPLIT_WORDS = {"val": "validation", "test": "test"}
SPLIT_TITLES = {"val": "Validation", "test": "Test"}
FLAG = "⚠"


def display_decimals(summaries: list[ArmSummary]) -> int:
    """Decimals of every accuracy of a split: the fewest (2 or 3) showing each exactly (in %)."""
    values = [100 * v for s in summaries for v in s.values.values()]
    return exact_decimals(values, 2, 3) if values else 2


def p_text(p: float) -> str:
    if not math.isfinite(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def contents(
    comparisons: list[Comparison], summaries: list[ArmSummary], expected: int, decimals: int
) -> list[tuple[Comparison, comparison.ComparisonContent | None]]:
    values = {s.arm: s.values for s in summaries}
    out = []
    for c in comparisons:
        if c.paired is None:
            out.append((c, None))
            continue
        cc = comparison.comparison_content(
            c.paired,
            c.bootstrap,
            values[c.a],
            values[c.b],
            a_label=c.a,
            b_label=c.b,
            split=SPLIT_WORDS[c.split],
            expected_n=expected,
        )
        # The per-seed display at the split's decimals, the same as the accuracy table's.
        per_seed = paired_display(
            [values[c.a][s] for s in cc.seeds], [values[c.b][s] for s in cc.seeds], 100.0, decimals
        )
        out.append((c, replace(cc, per_seed=per_seed)))
    return out


def results_section(
    study: StudyData,
    items: dict[str, list],
    interactions: dict[str, list] | None = None,
    n_resamples: int = tables.BOOTSTRAP_RESAMPLES,
) -> list[Block]:
    """Per split: the comparisons as a table, one stated result each, the caveats they share once, a forest plot;
    then the interactions asked for (``interaction_contents`` per split), if any."""
    blocks: list[Block] = [Heading(2, "Results")]
    for split, pairs in items.items():
        blocks += [Heading(3, SPLIT_TITLES[split])] + ([results_table(pairs)] if pairs else [])
        for c, cc in pairs:
            if cc is None:
                blocks.append(
                    Para(
                        f"{FLAG} {c.a} − {c.b} on {SPLIT_WORDS[split]}: {c.note or 'no paired seeds'}."
                    )
                )
            else:
                blocks.append(Quote(cc.paragraph.text))
        caveats = section_caveats(cc.paragraph for _, cc in pairs if cc is not None)
        if caveats:
            blocks.append(Para(caveats))
        rows = [cc.forest_row for c, cc in pairs if cc is not None and c.b == study.spec.reference]
        if rows:
            fig = forest.forest_plot(
                rows,
                study.spec.reference,
                metric=f"{SPLIT_WORDS[split]} accuracy",
                title=f"{SPLIT_TITLES[split]}: every arm against {study.spec.reference}",
            )
            blocks.append(
                Figure(
                    f"forest_{split}.png",
                    (
                        f"{SPLIT_TITLES[split]} accuracy, every arm minus the reference {study.spec.reference}, paired by seed: "
                        "dot = mean difference, thick bar = 95% t-interval over seeds, thin bar = 95% hierarchical bootstrap; "
                        "wins k of n = seeds where the arm is ahead."
                    ),
                    forest.figure_png(fig),
                )
            )
        blocks += interaction_blocks(study, split, (interactions or {}).get(split, []), n_resamples)
    return blocks


def results_table(pairs: list[tuple[Comparison, comparison.ComparisonContent | None]]) -> Table:
    """One row per comparison: mean, both intervals, who is ahead in how many seeds, and what the wider interval says."""
    body = []
    for c, cc in pairs:
        if cc is None:
            body.append(
                [
                    f"{c.a} − {c.b}",
                    "n/a",
                    "n/a",
                    "n/a",
                    f"0 of {c.expected_n} {FLAG}",
                    "no paired seeds",
                ]
            )
            continue
        p, par = c.paired, cc.paragraph
        ahead = par.ahead.replace(" seeds", "").replace(" seed", "") + (
            "" if p.n == c.expected_n else f" {FLAG}"
        )
        if par.sign_settled:
            sign = f"{par.settled_for} ahead ({par.driving_interval} excludes 0)"
        elif par.sign_settled is False:
            sign = f"not settled ({par.driving_interval} includes 0)"
        else:
            sign = "n/a (no interval)"
        boot = f"[{cc.bootstrap.low}, {cc.bootstrap.high}]" if cc.bootstrap else "n/a"
        t = (
            f"[{fmt(100 * p.ci_low, 2, True)}, {fmt(100 * p.ci_high, 2, True)}]"
            if math.isfinite(p.ci_low) and math.isfinite(p.ci_high)
            else "n/a"
        )
        body.append([f"{c.a} − {c.b}", fmt(100 * p.mean_difference, 2, True), t, boot, ahead, sign])
    return Table(
        ["a − b", "mean", "95% t-interval", "95% bootstrap", "seeds", "sign"],
        body,
        ["l", "r", "r", "r", "l", "l"],
        [
            "Differences in points. Sign: settled where the wider of the two intervals (named) excludes zero. "
            "Per-seed differences, effect sizes and p-values: Seed-paired comparisons."
        ],
    )


def comparison_section(study: StudyData, items: dict[str, list], n_resamples: int) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Seed-paired comparisons")]
    seeds = study.spec.seeds
    for split, pairs in items.items():
        body, notes = [], []
        for c, cc in pairs:
            p = c.paired
            if p is None or cc is None:
                body.append(
                    [
                        f"{c.a} − {c.b}",
                        f"0 of {c.expected_n} {FLAG}",
                        *["missing"] * len(seeds),
                        *["n/a"] * 7,
                    ]
                )
                notes.append(f"{c.a} − {c.b}: {c.note}")
                continue
            diffs = dict(zip(cc.seeds, cc.per_seed.differences))
            boot = f"[{cc.bootstrap.low}, {cc.bootstrap.high}]" if cc.bootstrap else "n/a"
            e = cc.effect
            effect = (
                "n/a"
                if not math.isfinite(e.d_z)
                else (
                    f"{e.d_z:+.2f}"
                    + (f" [{e.low:+.2f}, {e.high:+.2f}]" if math.isfinite(e.low) else "")
                )
            )
            won = f"{p.wins} of {p.n}" + (f" ({p.ties} tied)" if p.ties else "")
            n = f"{p.n} of {c.expected_n}" + ("" if p.n == c.expected_n else f" {FLAG}")
            body.append(
                [
                    f"{c.a} − {c.b}",
                    n,
                    *[diffs.get(x, "missing") for x in seeds],
                    fmt(100 * p.mean_difference, 2, True),
                    f"[{fmt(100 * p.ci_low, 2, True)}, {fmt(100 * p.ci_high, 2, True)}]"
                    # zero width: no spread, never certainty
                    + (f" {FLAG}" if p.ci_high == p.ci_low else ""),
                    boot,
                    effect,
                    won,
                    p_text(p.p_value),
                    p_text(p.wilcoxon_p_value),
                ]
            )
            if cc.bootstrap:
                notes.append(f"{c.a} − {c.b}: {cc.bootstrap.footnote}.")
            if p.note:
                notes.append(
                    f"{FLAG if p.n < c.expected_n else ''} {c.a} − {c.b}: {p.note}".strip()
                )
            if c.note:
                notes.append(f"{c.a} − {c.b}: {c.note}")
        n = len(seeds)
        first = next((cc for _, cc in pairs if cc is not None), None)
        methods = [
            (
                f"n: seeds with finished runs of both arms, of {n} in the protocol. Per-seed differences: a minus b, "
                "same seed, computed from the per-seed values as displayed in the Accuracy table, so each can be "
                "recomputed from that table; the mean and its t-interval are computed from the unrounded values."
            ),
            (
                f"t-interval: {tables.CONFIDENCE:.0%} Student-t interval of the mean difference over seeds (df = n − 1). "
                "p (paired t): two-sided paired t-test over seeds (scipy.stats.ttest_rel); p (Wilcoxon): exact signed-rank "
                f"test (scipy.stats.wilcoxon): with {n} seeds its smallest attainable two-sided p is "
                f"{min_wilcoxon_p(n):.3g}. No test was stated in advance: p-values are descriptive. Won: seeds where a > b."
            ),
            (
                f"Bootstrap: {tables.CONFIDENCE:.0%} hierarchical paired percentile bootstrap over seeds and examples "
                f"from the saved predictions/{split}.csv files ({n_resamples} resamples, seed {tables.BOOTSTRAP_SEED}): "
                "seeds resampled with replacement, then examples within each drawn seed, the same indices for both arms. "
                f"From {n} seeds it can draw only {bootstrap_seed_multisets(n)} distinct seed sets, so with few seeds its "
                "seed level is coarse: read it beside the t-interval (the wider of the two decides the wording above)."
            ),
        ]
        if first is not None:
            methods.append(f"Effect size: {first.effect.caveat}")
        blocks += [
            Heading(3, SPLIT_TITLES[split]),
            Table(
                [
                    "a − b",
                    "n",
                    *[f"seed {x}" for x in seeds],
                    "mean",
                    "95% t-interval",
                    "95% bootstrap",
                    "effect size d_z [95%]",
                    "won",
                    "p (paired t)",
                    "p (Wilcoxon)",
                ],
                body,
                ["l", "r", *["r"] * len(seeds), "r", "r", "r", "r", "r", "r", "r"],
                methods + notes,
            ),
        ]
    return blocks


# ------------------------------------------------------------- differences of differences


def interaction_contents(
    interactions: list[tables.Interaction], decimals: int
) -> list[tuple[tables.Interaction, interaction.InteractionContent | None]]:
    """Each interaction of a split with its content (None when no seed has all four arms)."""
    return [
        (
            ix,
            None
            if ix.paired is None
            else interaction.interaction_content(
                ix.paired,
                ix.bootstrap,
                ix.values,
                ix.arms,
                split=SPLIT_WORDS[ix.split],
                expected_n=ix.expected_n,
                decimals=decimals,
            ),
        )
        for ix in interactions
    ]


def interaction_blocks(study: StudyData, split: str, items: list, n_resamples: int) -> list[Block]:
    """The interactions of one split: a table, one stated result each, the methods, a forest plot."""
    if not items:
        return []
    seeds = study.spec.seeds
    body, notes = [], []
    for ix, ic in items:
        label = interaction.interaction_label(ix.arms)
        if ic is None:
            body.append(
                [label, f"0 of {ix.expected_n} {FLAG}", *["missing"] * len(seeds), *["n/a"] * 8]
            )
            notes.append(f"{label}: {ix.note}")
            continue
        p, par = ix.paired, ic.paragraph
        per_seed = dict(zip(ic.seeds, ic.per_seed))
        t = (
            f"[{fmt(100 * p.ci_low, 2, True)}, {fmt(100 * p.ci_high, 2, True)}]"
            if math.isfinite(p.ci_low) and math.isfinite(p.ci_high)
            else "n/a"
        )
        boot = f"[{ic.bootstrap.low}, {ic.bootstrap.high}]" if ic.bootstrap else "n/a"
        e = ic.effect
        effect = (
            "n/a"
            if not math.isfinite(e.d_z)
            else (
                f"{e.d_z:+.2f}"
                + (f" [{e.low:+.2f}, {e.high:+.2f}]" if math.isfinite(e.low) else "")
            )
        )
        if par.sign_settled:
            sign = f"{par.settled_for} larger ({par.driving_interval} excludes 0)"
        elif par.sign_settled is False:
            sign = f"not settled ({par.driving_interval} includes 0)"
        else:
            sign = "n/a (no interval)"
        n = f"{p.n} of {ix.expected_n}" + ("" if p.n == ix.expected_n else f" {FLAG}")
        won = f"{p.wins} of {p.n}" + (f" ({p.ties} tied)" if p.ties else "")
        body.append(
            [
                label,
                n,
                *[per_seed.get(s, "missing") for s in seeds],
                fmt(100 * p.mean_difference, 2, True),
                t,
                boot,
                effect,
                won,
                p_text(p.p_value),
                p_text(p.wilcoxon_p_value),
                sign,
            ]
        )
        if ic.bootstrap:
            notes.append(f"{label}: {ic.bootstrap.footnote}.")
        for note in (p.note, ix.note):
            if note:
                notes.append(f"{label}: {note}")
    methods = [
        (
            "Interaction: (a − b) − (c − d) per seed, e.g. what a change adds to one model minus what it adds to another; "
            "computed from the per-seed values as displayed in the Accuracy table; the mean and its t-interval from the "
            "unrounded values, over the seeds where all four arms finished."
        ),
        (
            f"t-interval: {tables.CONFIDENCE:.0%} Student-t interval of the mean interaction over seeds (df = n − 1); "
            "p (paired t), p (Wilcoxon): the per-seed a − b against c − d, descriptive (no test was stated in advance). "
            "Won: seeds where a − b is larger than c − d."
        ),
        (
            f"Bootstrap: {tables.CONFIDENCE:.0%} hierarchical percentile bootstrap over seeds and examples from the saved "
            f"predictions/{split}.csv files ({n_resamples} resamples, seed {tables.BOOTSTRAP_SEED}): seeds resampled with "
            "replacement, then examples within each drawn seed, the same seed and example indices for all four arms "
            "(which must be evaluated on the same examples)."
        ),
    ]
    blocks: list[Block] = [
        Heading(4, f"{SPLIT_TITLES[split]}: interactions"),
        Table(
            [
                "(a − b) − (c − d)",
                "n",
                *[f"seed {s}" for s in seeds],
                "mean",
                "95% t-interval",
                "95% bootstrap",
                "effect size d_z [95%]",
                "won",
                "p (paired t)",
                "p (Wilcoxon)",
                "sign",
            ],
            body,
            ["l", "r", *["r"] * len(seeds), "r", "r", "r", "r", "r", "r", "r", "l"],
            methods + notes,
        ),
    ]
    blocks += [Quote(ic.text) for _, ic in items if ic is not None]
    rows = [
        replace(ic.forest_row, arm=ic.label.replace(") − (", ")\n− ("))
        for _, ic in items
        if ic is not None
    ]
    if rows:
        fig = forest.forest_plot(
            rows,
            study.spec.reference,
            metric=f"{SPLIT_WORDS[split]} accuracy",
            title=f"{SPLIT_TITLES[split]}: interactions (a − b) − (c − d)",
            xlabel=f"{SPLIT_WORDS[split]} accuracy: (a − b) − (c − d) (points)",
        )
        blocks.append(
            Figure(
                f"interactions_{split}.png",
                (
                    f"{SPLIT_TITLES[split]} accuracy, interactions (a − b) − (c − d), paired by seed: dot = mean, thick bar = "
                    "95% t-interval over seeds, thin bar = 95% hierarchical bootstrap (the same seed and example draws for "
                    "all four arms); wins k of n = seeds where a − b is the larger difference."
                ),
                forest.figure_png(fig),
            )
        )
    return blocks
