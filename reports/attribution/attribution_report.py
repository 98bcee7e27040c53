"""The report of an attribution protocol: same pipeline, files and logging as the other kinds.

Per acted-on arm: the faithfulness table (per method: mean Spearman rho, deletion and insertion
AUC over seeds with t-intervals, the random baseline beside them), each method against the
random baseline paired by seed (t-interval) and by seed and image (hierarchical bootstrap),
the deletion and insertion curves with the range over seeds, a row of example images with each
method's map beside the causal-effect map, and the token norms per block (high-norm tokens,
the CLS attention they get, their causal effect) with histograms. Numbers come from
``reports.attribution.faithfulness`` over the per-image arrays every cell logged.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from reports import provenance
from reports.attribution import attribution_evidence
from reports.attribution.attribution_study import AttributionReadout
from reports.attribution.faithfulness import (
    BASELINE,
    BETTER,
    MEASURES,
    AttentionOnEffects,
    BlockConcentration,
    BlockNorms,
    MeasureRow,
    attention_on_effects,
    block_concentration,
    block_norms,
    faithfulness_rows,
    has_concentration,
    mean_curves,
)
from reports.common.report_parts import (
    ActedReport,
    FLAG,
    ActedBlocks,
    SPLIT_WORDS,
    acted_on_table,
)
from reports.attribution import arm_pairs, control_blocks
from reports.attribution.scored_sample import sample_blocks
from reports.attribution.controls import against_draws, has_draws
from reports.figures import report_png
from reports.output import paired_metrics
from reports.render import Block, Figure, Heading, Para, Table
from tracking.kinds.attribution_runs import AttributionCellResult
from tracking.record import queries
from workbench.analysis.common import display_images
from workbench.attribution import attribution_figures
from workbench.attribution.token_norms import PlantedControl
from workbench.protocol import AttributionProtocol
from reports.content.rounding import bootstrap_display, fmt
from workbench.stats import fisher_z_interval

# What reports.common.report_parts.ActedReport reads: the readout, the export, the summary's numbers.
READOUT = AttributionReadout
EVIDENCE = attribution_evidence
MEASURE_WORDS = {
    "rho": "Spearman ρ",
    "deletion_auc": "deletion AUC",
    "insertion_auc": "insertion AUC",
}
DECIMALS = 3
DIFFERENCES = "differences of Spearman ρ and of AUCs, method minus the random order"


def _interval(low: float, high: float, signed: bool = False) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return f"[{fmt(low, DECIMALS, signed)}, {fmt(high, DECIMALS, signed)}]"


def _settled(row: MeasureRow) -> int:
    """+1 when both intervals of (method - random) lie on the faithful side of zero, -1 on the other, else 0."""
    if row.vs_random is None or row.bootstrap is None:
        return 0
    t, b = row.vs_random, row.bootstrap
    if t.ci_low == t.ci_high:  # a zero-width t-interval is no spread, not certainty
        return 0
    for side in (1.0, -1.0):
        if min(side * t.ci_low, side * t.ci_high) > 0 and min(side * b.low, side * b.high) > 0:
            return int(side * BETTER[row.measure])
    return 0


def faithfulness_table(rows: list[MeasureRow], confidence: float) -> Table:
    by = {(r.method, r.measure): r for r in rows}
    methods = list(dict.fromkeys(r.method for r in rows))
    body = []
    for m in methods:
        line = [f"`{m}`" + (" (baseline)" if m == BASELINE else "")]
        for measure in MEASURES:
            r = by[(m, measure)]
            o = r.over_seeds
            low, high = (
                fisher_z_interval(list(r.per_seed.values()), confidence)
                if measure == "rho"
                else (o.ci_low, o.ci_high)
                if o is not None
                else (math.nan, math.nan)
            )
            line += (
                ["n/a", "n/a"]
                if o is None
                else [
                    fmt(r.mean, DECIMALS, measure == "rho"),
                    _interval(low, high, measure == "rho"),
                ]
            )
        line.append(str(sum(by[(m, "rho")].undefined.values())))
        body.append(line)
    c = f"{confidence:.0%} t"
    return Table(
        [
            "method",
            "Spearman ρ",
            f"{confidence:.0%} Fisher z",
            "deletion AUC",
            c,
            "insertion AUC",
            c,
            "images without ρ",
        ],
        body,
        ["l", "r", "r", "r", "r", "r", "r", "r"],
        [
            "Per image: Spearman ρ between the method's patch scores and the exact causal effect of each patch "
            "token (log p(true class) of the intact model minus that of the same model without that one token), "
            "and the area under the true-class probability as patch tokens are removed (deletion: lower is more "
            "faithful) or kept (insertion: higher is more faithful) in the method's order, most important first; "
            "AUC by the trapezoid rule over the fractions 0 to 1, both ends included. A seed's value is the mean "
            "over its images (ρ: over the images where it is defined; it is not where the scores or the effects "
            "are constant, counted in the last column over all seeds). Mean over seeds with the Student-t "
            "interval over seeds (df = n − 1; none for one seed, zero width when every seed agrees); for ρ the "
            "t-interval is taken on Fisher's z = artanh(ρ) of the seed values and mapped back, so it stays "
            "inside [−1, 1]."
        ],
        css_class="wide",
    )


def random_table(rows: list[MeasureRow], confidence: float, n_resamples: int) -> Table:
    body = []
    for r in rows:
        if r.vs_random is None:
            continue
        t, b = r.vs_random, r.bootstrap
        shown = bootstrap_display(b, 1.0, "", max_decimals=4, estimate_decimals=DECIMALS)
        mark = {1: " ✓", -1: " ✗", 0: ""}[_settled(r)]
        body.append(
            [
                f"`{r.method}`",
                MEASURE_WORDS[r.measure],
                fmt(t.mean_difference, DECIMALS, True) + mark,
                _interval(t.ci_low, t.ci_high, True),
                f"[{shown.low}, {shown.high}]",
                f"{r.better_in()} of {t.n}",
                " / ".join(fmt(d, DECIMALS, True) for d in t.differences),
            ]
        )
    return Table(
        [
            "method",
            "measure",
            "mean − random",
            f"{confidence:.0%} t-interval",
            f"{confidence:.0%} bootstrap",
            "better in",
            "per seed",
        ],
        body,
        ["l", "l", "r", "r", "r", "r", "r"],
        [
            "Each method against the seeded random order on the same cells and images: the difference of the "
            "seed values (method − random). t-interval: Student-t over the per-seed differences; bootstrap: "
            f"hierarchical over seeds, then images ({n_resamples:,} resamples; the same images for both). "
            "'better in': seeds where the method was more faithful than random (higher ρ or insertion AUC, lower "
            "deletion AUC). ✓ where both intervals lie on the faithful side of zero, ✗ where both lie on the "
            "other side; otherwise the seeds and images do not settle it. Per seed in seed order."
        ],
        css_class="wide",
    )


def results_paragraph(arm: str, rows: list[MeasureRow], split: str) -> str:
    """One paragraph per arm: per method and measure whether it beats the random order, in careful words."""
    by = {(r.method, r.measure): r for r in rows}
    parts = []
    for m in dict.fromkeys(r.method for r in rows):
        if m == BASELINE:
            continue
        said = []
        for measure in MEASURES:
            r = by[(m, measure)]
            if r.vs_random is None:
                continue
            verdict = {
                1: "more faithful than the random order",
                -1: "less faithful than the random order",
                0: "not settled against the random order",
            }[_settled(r)]
            base = by[(BASELINE, measure)]
            said.append(
                f"{MEASURE_WORDS[measure]} {fmt(r.mean, DECIMALS, measure == 'rho')} against "
                f"{fmt(base.mean, DECIMALS, measure == 'rho')} ({verdict}, better in {r.better_in()} of "
                f"{r.vs_random.n} seeds)"
            )
        if said:
            parts.append(f"`{m}`: " + "; ".join(said))
    return (
        f"**{arm}**, {split} images: " + ". ".join(parts) + "."
        if parts
        else f"**{arm}**: no method to compare with the random baseline."
    )


def norms_table(blocks: list[BlockNorms], k: float) -> Table:
    def mean(values: dict) -> float:
        finite = [v for v in values.values() if math.isfinite(v)]
        return float(np.mean(finite)) if finite else math.nan

    body = []
    for b in blocks:
        top = sorted(b.positions.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        body.append(
            [
                str(b.block),
                fmt(mean(b.median), 2),
                fmt(mean(b.max_ratio), 2),
                fmt(100 * mean(b.fraction), 2),
                str(sum(b.images_with.values())),
                fmt(100 * mean(b.attention_share), 1),
                fmt(100 * mean(b.token_share), 1),
                fmt(mean(b.effect_high), DECIMALS, True),
                fmt(mean(b.effect_other), DECIMALS, True),
                ", ".join(f"({r}, {c}) ×{n}" for (r, c), n in top) or "none",
            ]
        )
    return Table(
        [
            "block",
            "median norm",
            "max / median",
            f"> {k:g} × median, %",
            "images with one",
            "their CLS attention, %",
            "their token share, %",
            "their effect",
            "others' effect",
            "where (row, col)",
        ],
        body,
        ["r"] * 9 + ["l"],
        [
            f"L2 norm of every patch token after each block (the residual stream); high-norm: above {k:g} × the "
            "block's median patch-token norm. Per seed, then the mean over seeds (images with one: summed). CLS "
            "attention: the last block's class-token attention over the patches (heads averaged), the "
            "high-norm tokens' share of it against their share of the tokens, over the images that have one: "
            "a share far above the token share means CLS attends to them. Effect: the mean exact causal effect "
            "(log-probability of the true class lost when the token alone is removed). Where: the patch "
            "positions most often high-norm, over every seed and image."
        ],
        css_class="wide nowrap",
    )


def norm_control_failures(arm: str, cells: dict[int, AttributionCellResult]) -> list[str]:
    """A warning per cell whose high-norm detector missed its planted token (or flagged one below k)."""
    k = float(next(iter(cells.values())).arrays["norm_threshold"])
    out = []
    for seed, cell in sorted(cells.items()):
        c = PlantedControl.from_arrays(cell.arrays, k)
        if c is not None and not c.detects:
            out.append(
                f"{arm}/seed{seed}: the high-norm detector failed its planted positive control "
                f"(flagged share per planted ratio {', '.join(f'{r:g}: {f:.2f}' for r, f in zip(c.ratios, c.flagged))}): "
                "its count of high-norm tokens says nothing"
            )
    return out


def norm_control_paras(cells: dict[int, AttributionCellResult]) -> list[Block]:
    """What the detector's planted positive control showed per seed (nothing for evidence exported
    before the control existed)."""
    k = float(next(iter(cells.values())).arrays["norm_threshold"])
    controls = {s: PlantedControl.from_arrays(c.arrays, k) for s, c in sorted(cells.items())}
    if any(c is None for c in controls.values()):
        return []
    first = next(iter(controls.values()))

    def seed_words(seed: int, c: PlantedControl) -> str:
        flagged = (
            f"flagged in every image from {fmt(c.threshold, 2)} ×"
            if math.isfinite(c.threshold)
            else "never flagged in every image"
        )
        below = "none" if (c.flagged[c.ratios < k] == 0).all() else "some"
        return (
            f"seed {seed}: {flagged}, {below} below {k:g} ×; "
            f"{fmt(100 * c.clean_flagged, 2)} % of its patch tokens flagged with nothing planted"
        )

    verdict = (
        f"The detector was shown to detect: the planted token is flagged in every image from just above "
        f"{k:g} × the median up, and never below {k:g} ×."
        if all(c.detects for c in controls.values())
        else f"{FLAG} The detector failed its positive control: its count of high-norm tokens here says nothing."
    )
    return [
        Para(
            f"Positive control of the high-norm detector (docs/attribution.md): in the first {first.images} scored "
            f"images, patch token {first.position} of block {first.block}'s residual stream is set to r × the "
            f"block's median patch-token norm (its direction kept), for r in "
            f"{', '.join(f'{r:g}' for r in first.ratios)}, and the same detector is run on the planted stream "
            f"({'; '.join(seed_words(s, c) for s, c in controls.items())}). {verdict}"
        )
    ]


def attention_table(a: AttentionOnEffects) -> Table:
    seeds = sorted(a.on_top_effects)
    body = [
        [
            str(s),
            fmt(100 * a.on_top_effects[s], 1),
            fmt(100 * a.chance, 1),
            fmt(100 * a.concentration[s], 1),
        ]
        for s in seeds
    ]
    if len(seeds) > 1:
        body.append(
            [
                "mean",
                fmt(100 * float(np.mean([a.on_top_effects[s] for s in seeds])), 1),
                fmt(100 * a.chance, 1),
                fmt(100 * float(np.mean([a.concentration[s] for s in seeds])), 1),
            ]
        )
    return Table(
        [
            "seed",
            f"CLS attention on the {a.top} tokens of largest effect, %",
            "uniform attention, %",
            f"CLS attention on its own {a.top} most-attended tokens, %",
        ],
        body,
        ["l", "r", "r", "r"],
        [
            f"Per image, the share of the last block's class-token attention over the patch tokens (heads "
            f"averaged) that falls on the {a.top} patch tokens whose removal alone lowers the true class's "
            f"log-probability most, then the mean over the seed's images; uniform attention would put "
            f"{a.top} / {round(a.top / a.chance)} of it there. The last column says how concentrated the "
            "attention is: its share on its own most-attended tokens."
        ],
    )


def _seed_mean(values: dict[int, float]) -> float:
    finite = [v for v in values.values() if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def _registers(n: int) -> str:
    return f"{n} register{'s' if n != 1 else ''}"


def concentration_table(blocks: list[BlockConcentration]) -> Table:
    first = blocks[0]
    k, p, registers = first.top_k, first.patches, first.registers_count
    body = []
    for b in blocks:
        line = [
            str(b.block),
            fmt(_seed_mean(b.entropy), DECIMALS),
            fmt(_seed_mean(b.lowest_head_entropy), DECIMALS),
            fmt(100 * _seed_mean(b.top1), 1),
            fmt(100 * _seed_mean(b.topk), 1),
            fmt(100 * _seed_mean(b.self_share), 1),
        ]
        if registers:
            line += [
                fmt(100 * _seed_mean(b.registers), 1),
                fmt(_seed_mean(b.register_norm_ratio), 2),
            ]
        body.append(line)
    header = [
        "block",
        "entropy (1 = uniform)",
        "most concentrated head's entropy",
        "top-1 patch, %",
        f"top {k} patches, %",
        "on CLS itself, %",
    ]
    if registers:
        header += [f"on the {_registers(registers)}, %", "register norm / patch median"]
    words = (
        (
            f" With {_registers(registers)}: the share of the whole row they receive, and their mean L2 norm "
            "after the block over the block's median patch-token norm (register norms are never in the patch "
            "statistics above)."
        )
        if registers
        else " The model has no register tokens."
    )
    return Table(
        header,
        body,
        ["r"] * len(header),
        [
            f"How concentrated the class token's attention is, per block: its row of the attention map, heads "
            f"averaged (the most concentrated head: the lowest of the heads' mean entropies), over the {p} patch "
            "tokens renormalised to 1: normalised entropy −Σ q log q / log P (1: uniform, 0: all on one token), "
            f"the share on the top patch token and on the top {k} (⌈P / 10⌉; uniform attention: "
            f"{fmt(100 / p, 1)} % and {fmt(100 * k / p, 1)} %); and the share of the whole row the class token "
            "gives itself."
            + words
            + " Per seed the mean over its images, then the mean over seeds (the "
            "figure shows the seeds' range)."
        ],
        css_class="wide nowrap",
    )


def concentration_panels(blocks: list[BlockConcentration]) -> tuple[dict, dict]:
    def per_seed(field: str) -> np.ndarray:  # (seeds, L)
        return np.array([[getattr(b, field)[s] for b in blocks] for s in sorted(blocks[0].entropy)])

    first = blocks[0]
    panels = {
        "normalised entropy over the patches": {
            "heads averaged": per_seed("entropy"),
            "most concentrated head": per_seed("lowest_head_entropy"),
        },
        "share on the top patch tokens": {
            "top 1": per_seed("top1"),
            f"top {first.top_k}": per_seed("topk"),
        },
    }
    if first.registers_count:
        panels["share of the whole row"] = {
            f"on the {_registers(first.registers_count)}": per_seed("registers"),
            "on CLS itself": per_seed("self_share"),
        }
    else:
        panels["share of the whole row"] = {"on CLS itself": per_seed("self_share")}
    uniform = {
        f"uniform, top {first.top_k}": first.top_k / first.patches,
        "uniform, top 1": 1 / first.patches,
    }
    return panels, {
        "normalised entropy over the patches": {"uniform attention": 1.0},
        "share on the top patch tokens": uniform,
    }


def arm_blocks(
    arm: str,
    rows: list[MeasureRow],
    cells: dict[int, AttributionCellResult],
    protocol: AttributionProtocol,
    n_resamples: int,
    draws: list | None = None,
) -> list[Block]:
    """Every table and figure of one acted-on arm."""
    e, s = protocol.evaluation, protocol.settings
    methods = next(iter(cells.values())).methods
    blocks: list[Block] = [
        Heading(2, f"Faithfulness ({arm})"),
        faithfulness_table(rows, e.confidence),
    ]
    if any(r.vs_random is not None for r in rows) and not draws:
        blocks += [
            Heading(3, f"Against the random baseline ({arm})"),
            random_table(rows, e.confidence, n_resamples),
        ]
    curves = {
        kind: {m: mean_curves(cells, m, kind) for m in methods}
        for kind in ("deletion", "insertion")
    }
    fractions = next(iter(curves["deletion"].values()))[0]
    blocks += [
        Heading(2, f"Deletion and insertion curves ({arm})"),
        Figure(
            f"curves_{arm}.png",
            (
                "True-class probability as patch tokens are removed (left) or kept (right) in each method's order, most "
                "important first, by the exact token drop (the same model on the shorter sequence; class and register tokens "
                "kept). Line: mean over seeds of each seed's mean over images (the legend's AUC is that line's); band: the "
                "range over seeds. The random order (dashed) is the baseline."
            ),
            report_png(
                attribution_figures.curves_figure(
                    fractions,
                    {m: c for m, (_, c) in curves["deletion"].items()},
                    {m: c for m, (_, c) in curves["insertion"].items()},
                    f"{protocol.name}: {arm}",
                )
            ),
        ),
    ]
    seed = min(cells)
    a = cells[seed].arrays
    shown = len(a["example_images"])
    if shown:
        grid = (int(a["grid"][0]), int(a["grid"][1]))
        titles = [
            f"class {int(y)}, predicted {int(p)}"
            for y, p in zip(a["labels"][:shown], a["predicted"][:shown])
        ]
        blocks += [
            Heading(2, f"Examples ({arm})"),
            Figure(
                f"examples_{arm}.png",
                (
                    f"The first {shown} scored images with seed {seed}'s model: each method's map on the patch grid (scale per "
                    "map; centred on zero for a map with negative scores) beside the causal-effect map (red: removing the "
                    "token lowers the true class's log-probability; blue: raises it; scale per image)."
                ),
                report_png(
                    attribution_figures.example_maps_figure(
                        display_images(torch.from_numpy(a["example_images"])),
                        {
                            m: a[f"scores/{m}"][:shown].reshape(shown, *grid)
                            for m in methods
                            if m != BASELINE
                        },
                        a["effects"][:shown].reshape(shown, *grid),
                        titles,
                    )
                ),
            ),
        ]
    blocks += control_blocks.control_blocks(
        arm,
        rows,
        cells,
        draws or [],
        confidence=e.confidence,
        n_resamples=n_resamples,
        seed=e.seed,
        dataset=control_blocks.dataset_of(protocol),
        title=f"{protocol.name}: {arm}",
    )
    blocks += [
        Heading(2, f"Does CLS attend to the tokens that matter? ({arm})"),
        attention_table(attention_on_effects(cells)),
    ]
    if has_concentration(
        cells
    ):  # evidence exported before these arrays existed has none: the section is left out
        concentration = block_concentration(cells)
        panels, reference = concentration_panels(concentration)
        blocks += [
            Heading(2, f"Attention concentration per block ({arm})"),
            concentration_table(concentration),
            Figure(
                f"concentration_{arm}.png",
                (
                    "The class token's attention per block: normalised entropy over the patch tokens (heads "
                    "averaged, and the most concentrated head), its share on the top patch tokens, and the share of "
                    "its whole row on itself (and on the register tokens, where the model has them). Line: mean "
                    "over seeds; band: the range over seeds; dotted: uniform attention over the patches."
                ),
                report_png(
                    attribution_figures.concentration_figure(
                        panels, f"{protocol.name}: {arm}, CLS attention per block", reference
                    )
                ),
            ),
        ]
    blocks += [
        Heading(2, f"Token norms ({arm})"),
        norms_table(block_norms(cells), s.norm_threshold),
        *norm_control_paras(cells),
    ]
    for seed, c in sorted(cells.items()):
        blocks.append(
            Figure(
                f"norms_{arm}_seed{seed}.png",
                (
                    f"Seed {seed}: the L2 norm of every patch token of every scored image after each block (log bins, log "
                    f"counts); dashed: the high-norm cut at {s.norm_threshold:g} × the block's median."
                ),
                report_png(
                    attribution_figures.norm_histograms_figure(
                        c.arrays["norms"].transpose(1, 0, 2),
                        c.arrays["median_norm"],
                        s.norm_threshold,
                        f"{protocol.name}: {arm}, seed {seed}",
                    )
                ),
            )
        )
    return blocks


def acted_on_blocks(rows: list[tuple[str, int, queries.CellRecord]]) -> list[Block]:
    """Which weights each cell acted on, its reload proof, and how long its scoring took."""
    return acted_on_table(
        rows,
        ["intact accuracy, %", "images", "sequences", "scoring"],
        lambda m: [
            fmt(100 * m.get("intact_accuracy", math.nan), 2),
            f"{int(m.get('images', 0)):,}",
            f"{int(m.get('forwards', 0)):,}",
            f"{m.get('evaluation_seconds', math.nan):.1f} s",
        ],
        "Trained run: the finished cell whose best checkpoint was loaded; before anything was scored it had to "
        "reproduce that run's saved validation predictions (bitwise on CPU). Sequences: token sequences run through "
        "the blocks for the single-token drops and the curves. Scoring: wall time of the methods, the drops, the "
        "curves and the norms.",
    )


# The attribution report compares arms on request (``--compare A:B``); ``reports.build`` asks this.
COMPARES_ARMS = True


def compared_arms(
    built: ActedBlocks, inputs: provenance.BuildInputs, n_resamples: int
) -> list[Block]:
    """The ``--compare`` pairs' section (empty without any), before the per-arm sections."""
    if not inputs.compare:
        return []
    e, s = built.study.protocol.evaluation, built.study.protocol.settings
    arms = dict(built.reported_arms())
    blocks: list[Block] = [
        Heading(2, "Arm against arm"),
        Para(
            "Each pair asked for with `--compare A:B`: the same methods, scored on the same images, in "
            "two acted-on arms."
        ),
    ]
    for a, b in inputs.compare:
        missing = [arm for arm in (a, b) if arm not in arms]
        if missing:
            built.warnings.append(
                f"--compare {a}:{b}: no reported cell of {', '.join(missing)}; the pair is left out"
            )
            continue
        blocks += arm_pairs.pair_blocks(
            a,
            b,
            arms[a],
            arms[b],
            n_resamples=n_resamples,
            confidence=e.confidence,
            seed=e.seed,
            norm_threshold=s.norm_threshold,
            split=SPLIT_WORDS[s.split],
        )
    return blocks


def build_blocks(
    study: AttributionReadout,
    inputs: provenance.BuildInputs,
    log_targets: list[str],
    n_resamples: int,
) -> tuple[list[Block], list[str], list[str], int, dict[str, float]]:
    """The report's blocks, its warnings, what ``--strict`` refuses, the number of reported cells, and each
    method's comparison with the random baseline as ``cmp.<arm>.<method>.<measure>_vs_random.<split>.*`` metrics."""
    protocol, built = study.protocol, ActedBlocks(study)
    e, s = protocol.evaluation, protocol.settings
    split = SPLIT_WORDS[s.split]
    answers: list[Block] = []
    for arm, cells in built.reported_arms():
        rows = faithfulness_rows(cells, n_resamples, e.confidence, e.seed)
        draws = against_draws(cells, n_resamples, e.confidence, e.seed) if has_draws(cells) else []
        built.warnings += control_blocks.near_chance(
            arm, cells, control_blocks.num_classes_of(protocol, arm, cells)
        )
        built.warnings += norm_control_failures(arm, cells)
        answers.append(control_blocks.answers(arm, rows, cells, e.confidence, draws))
        for r in rows:
            if r.vs_random is not None:
                built.metrics |= paired_metrics(
                    f"{arm}.{r.method}.{r.measure}",
                    BASELINE,
                    s.split,
                    r.vs_random,
                    r.bootstrap,
                    scale=1.0,
                )
        accuracy = ", ".join(
            fmt(100 * float((c.arrays["predicted"] == c.arrays["labels"]).mean()), 2)
            for c in cells.values()
        )
        built.results.append(
            Para(
                f"**{arm}**: intact accuracy {accuracy} % on the {len(next(iter(cells.values())).arrays['labels'])} "
                f"scored {split} images (seeds {', '.join(map(str, cells))})."
            )
        )
        built.results.append(
            control_blocks.draws_paragraph(arm, draws, split)
            if draws
            else Para(results_paragraph(arm, rows, split))
        )
        built.sections += arm_blocks(arm, rows, cells, protocol, n_resamples, draws)
    built.sections = compared_arms(built, inputs, n_resamples) + built.sections
    sample, thin = sample_blocks(protocol, list(built.reported_arms()))
    built.results.append(
        Para(
            "Faithful here means agreeing with what the exact token drop measures on this model; a map "
            "can be faithful and still not be an explanation a person can use, and the random order is "
            "the floor, not a target."
        )
    )
    blocks, warnings, refused, n, metrics = built.finish(
        inputs,
        log_targets,
        acted_on_blocks,
        what="Attribution",
        settings=f"{_images_words(s)} {split} images; methods {', '.join(f'`{m}`' for m in s.methods)} "
        f"(random order seed {s.random_seed}); high-norm cut {s.norm_threshold:g} × the block median.",
        after_header=[
            *sample,
            Heading(2, "In one line per method"),
            *answers,
            Para(
                f"ρ with its {e.confidence:.0%} interval taken on Fisher's z over seeds; an AUC is better than random when "
                "deletion is lower or insertion higher. The sections below give every interval."
            ),
            Heading(2, "Methods, named exactly"),
            Para(control_blocks.NAMED),
        ],
    )
    # a sample too thin for the data is refused by --strict, as a missing cell is
    thin = [f"sample: {t}" for t in thin]
    return blocks, warnings + thin, refused + thin, n, metrics


def _images_words(s) -> str:
    """The header's words for the scored images (a protocol frozen before ``sample``: "the first N")."""
    return {
        "first": f"the first {s.images:,}",
        "stratified": f"a class-stratified sample (seed {s.sample_seed}) of {s.images:,}",
        "indices": f"the {s.images:,} named",
    }[s.sample]


# This kind's report builder, which the table of kinds names.
REPORT = ActedReport(sys.modules[__name__])
