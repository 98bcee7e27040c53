"""The controls' part of an attribution report: one line per method, the methods named, and per
arm the oracle, the insertion start, the random draws, method against method, per class and the
sanity check. Numbers come from ``reports.attribution.controls``; each section appears when the
cells logged what it needs (evidence exported before the controls existed has no draws, no
sanity check and no insertion start).
"""

from __future__ import annotations

import math

import numpy as np

from reports.attribution import controls
from reports.attribution.faithfulness import BASELINE, BETTER, MEASURES, MeasureRow
from reports.figures import report_png
from reports.render import Block, Bullets, Figure, Heading, Para, Table
from tracking.kinds.attribution_runs import AttributionCellResult
from workbench.attribution import attribution_figures
from workbench.attribution.controls import MODEL_FREE, SURVIVES
from workbench.data import cifar10, fashion_mnist
from reports.content.rounding import bootstrap_display, fmt

D = 3  # decimals
WORDS = {"rho": "Spearman ρ", "deletion_auc": "deletion AUC", "insertion_auc": "insertion AUC"}
NEAR_CHANCE = 2.0  # a cell whose intact accuracy is below this multiple of chance is warned of
CLASS_NAMES = {"fashion_mnist": fashion_mnist.CLASS_NAMES, "cifar10": cifar10.CLASS_NAMES}
NAMED = (
    "`cls_attention`: the last block's class-token attention over the patch tokens, heads "
    "averaged. `rollout`: attention rollout (Abnar & Zuidema, ACL 2020), R = ∏ (0.5 A + 0.5 I) "
    "over the blocks, heads averaged, the class token's row. `chefer`: Chefer, Gur & Wolf, "
    '"Generic Attention-model Explainability for Interpreting Bi-Modal and Encoder-Decoder '
    'Transformers" (ICCV 2021), the generic rule for self-attention (their eqs. 5 and 6: '
    "R ← R + E_h[(∂z/∂A) ⊙ A]⁺ R per block), explaining the true class's logit, not the "
    "predicted one. `grad_x_input`: the input gradient of the true class's logit times the "
    "input, summed per patch. `random`: a random order (the floor). Controls: `intensity` (each "
    "patch's mean input value), `centre` (a centre prior: minus the patch's distance from the "
    "image centre) and `oracle` (the exact single-token effects themselves, a reference no map "
    "can be: ρ = 1 by construction)."
)


def _i(low: float, high: float, signed: bool = True) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return f"[{fmt(low, D, signed)}, {fmt(high, D, signed)}]"


def difference_interval(measure: str, low: float, high: float) -> str:
    """A difference's t-interval, cut to the range a difference can take (ρ: [−2, 2], an AUC:
    [−1, 1]) and marked ‡ where it was cut: with few seeds a raw t-interval can reach beyond."""
    bound = 2.0 if measure == "rho" else 1.0
    if not (math.isfinite(low) and math.isfinite(high)) or (-bound <= low and high <= bound):
        return _i(low, high)
    return _i(max(low, -bound), min(high, bound)) + " ‡"


CUT = (
    "‡: the t-interval reached beyond the range a difference can take (ρ: [−2, 2]; an AUC: "
    "[−1, 1]) and is cut there; with this few seeds read the bootstrap."
)


def class_names(dataset: str | None, classes) -> dict[int, str]:
    names = CLASS_NAMES.get(dataset or "", ())
    return {k: names[k] if k < len(names) else f"class {k}" for k in classes}


def near_chance(arm: str, cells: dict[int, AttributionCellResult], num_classes: int) -> list[str]:
    """A warning per cell whose intact accuracy is below ``NEAR_CHANCE`` x chance (1 / classes)."""
    out = []
    for s, cell in sorted(cells.items()):
        a = cell.arrays
        accuracy = float((a["predicted"] == a["labels"]).mean())
        if accuracy < NEAR_CHANCE / num_classes:
            out.append(
                f"{arm}/seed{s}: intact accuracy {fmt(100 * accuracy, 2)} % on the scored images, "
                f"below {NEAR_CHANCE:g} × chance, {fmt(100 * NEAR_CHANCE / num_classes, 2)} % "
                f"(chance: {fmt(100 / num_classes, 2)} %): its maps explain "
                "a model that has learnt little, so their faithfulness says little"
            )
    return out


def answers(
    arm: str,
    rows: list[MeasureRow],
    cells: dict[int, AttributionCellResult],
    confidence: float,
    draws,
) -> Bullets:
    """One line per method: its rho with the Fisher-z interval, and per AUC how often it beat random."""
    lines = []
    by_draw = {(d.method, d.measure): d for d in draws}
    by = {(r.method, r.measure): r for r in rows}
    sanity = controls.sanity_verdicts(cells)
    every = "every layer" if controls.sanity_form(cells) == "cascade" else "every block"
    n = len(cells)
    for m in dict.fromkeys(r.method for r in rows):
        if m == BASELINE:
            continue
        mean, (low, high) = controls.rho_interval(cells, m, confidence)
        said = [f"ρ {fmt(mean, D, True)} {_i(low, high)}"]
        for measure in ("deletion_auc", "insertion_auc"):
            d = by_draw.get((m, measure))
            if d is not None:
                better = sum(BETTER[measure] * x > 0 for x in d.versus.differences)
                said.append(
                    f"{WORDS[measure]} better than the mean of {d.draws} random draws in {better} of {n} seeds"
                )
            elif by.get((m, measure)) is not None and by[(m, measure)].vs_random is not None:
                said.append(
                    f"{WORDS[measure]} better than the one random order in "
                    f"{by[(m, measure)].better_in()} of {n} seeds"
                )
        if m in sanity:
            said.append(
                f"survives the randomisation of {every} (does not depend on the weights) ⚠"
                if sanity[m].survives
                else f"changes when {every.replace('every', 'the')}s are randomised"
            )
        lines.append(f"`{m}` ({arm}): " + "; ".join(said) + ".")
    return Bullets(lines)


def _oracle_para(cells: dict[int, AttributionCellResult], rows: list[MeasureRow]) -> Para | None:
    by = {(r.method, r.measure): r.mean if r.over_seeds else math.nan for r in rows}
    methods = list(dict.fromkeys(r.method for r in rows))
    if controls.ORACLE not in methods:
        return None
    others = [m for m in methods if m not in (controls.ORACLE, BASELINE)]
    others = [m for m in others if math.isfinite(by[(m, "deletion_auc")])]
    best = min(others, key=lambda m: by[(m, "deletion_auc")]) if others else None
    compare = (
        f"; the lowest deletion AUC of the maps is `{best}`'s {fmt(by[(best, 'deletion_auc')], D)}"
        f" (insertion {fmt(by[(best, 'insertion_auc')], D)})"
        if best
        else ""
    )
    return Para(
        "What the two kinds of number measure. Spearman ρ asks whether a map ranks the patch "
        "tokens as removing each one *alone* changes the true class's log-probability. Deletion "
        "and insertion remove or keep tokens *together*, where their effects need not add up. "
        f"The oracle, whose scores are the single-token effects themselves, has ρ "
        f"{fmt(by[(controls.ORACLE, 'rho')], D, True)} and deletion AUC {fmt(by[(controls.ORACLE, 'deletion_auc')], D)}"
        f" (insertion {fmt(by[(controls.ORACLE, 'insertion_auc')], D)}){compare}: a perfect ρ is no "
        "promise of the best curve, and a better curve no promise of a better ρ."
    )


def _start_blocks(
    arm: str, cells: dict[int, AttributionCellResult], names: dict[int, str]
) -> list[Block]:
    rows = controls.insertion_start(cells)
    body = [
        [
            str(r.seed),
            names.get(r.predicted, f"class {r.predicted}"),
            fmt(100 * r.share, 1),
            fmt(r.prob, D),
            fmt(r.true_class_prob, D),
        ]
        for r in rows
    ]
    return [
        Heading(3, f"Where the insertion curve starts ({arm})"),
        Table(
            ["seed", "class predicted", "% of images", "its probability", "true-class prob."],
            body,
            ["r", "l", "r", "r", "r"],
            [
                "The insertion curve's first point is the class (and register) tokens alone, no patch: "
                "the same sequence for every image, so each model predicts one class there, with the "
                "probability shown. Insertion AUC therefore starts high for images of that class and "
                "low for the others: a class bias every method shares, which the per-class table shows."
            ],
        ),
    ]


def _draw_blocks(arm, cells, draws, confidence, n_resamples) -> list[Block]:
    spread = controls.draw_spread(cells)
    seeds = sorted(cells)
    body = [
        [
            WORDS[s.measure],
            " / ".join(fmt(s.mean[k], D, s.measure == "rho") for k in seeds),
            " / ".join(fmt(s.sd[k], 4) for k in seeds),
            " / ".join(_i(s.low[k], s.high[k], s.measure == "rho") for k in seeds),
        ]
        for s in spread
    ]
    rows = []
    for d in draws:
        shown = bootstrap_display(d.bootstrap, 1.0, "", max_decimals=4, estimate_decimals=D)
        mark = {1: " ✓", -1: " ✗", 0: ""}[d.settled()]
        rows.append(
            [
                f"`{d.method}`",
                WORDS[d.measure],
                fmt(d.versus.mean_difference, D, True) + mark,
                difference_interval(d.measure, d.versus.ci_low, d.versus.ci_high),
                f"[{shown.low}, {shown.high}]",
                " / ".join(str(d.beats.get(k, "n/a")) for k in seeds) + f" of {d.draws}",
            ]
        )
    n_draws = draws[0].draws if draws else 0
    return [
        Heading(3, f"Against {n_draws} random draws per image ({arm})"),
        Table(
            [
                "measure",
                "draws' mean per seed",
                "SD of the draws' means",
                "range of the draws' means",
            ],
            body,
            ["l", "r", "r", "r"],
            [
                f"Each image has {n_draws} random orders of its own, seeded by the protocol's random seed, the "
                "cell's seed, the image's index and the draw; per seed in seed order. The SD is the spread "
                "a single random order would carry."
            ],
        ),
        Table(
            [
                "method",
                "measure",
                "mean − draws",
                f"{confidence:.0%} t-interval",
                "bootstrap",
                "draws beaten per seed",
            ],
            rows,
            ["l", "l", "r", "r", "r", "r"],
            [
                "Each method against the mean of the random draws on the same cells and images: t-interval "
                "over the per-seed differences; bootstrap hierarchical over seeds then images against each "
                f"image's mean over the draws ({n_resamples:,} resamples). ✓ / ✗ where both intervals lie on "
                "the faithful / unfaithful side of zero. " + CUT
            ],
        ),
    ]


def _pair_blocks(arm, pairs, confidence, n_resamples) -> list[Block]:
    body = []
    for p in pairs:
        shown = bootstrap_display(p.bootstrap, 1.0, "", max_decimals=4, estimate_decimals=D)
        body.append(
            [
                f"`{p.a}` − `{p.b}`",
                WORDS[p.measure],
                fmt(p.versus.mean_difference, D, True),
                difference_interval(p.measure, p.versus.ci_low, p.versus.ci_high),
                f"[{shown.low}, {shown.high}]",
                " / ".join(fmt(x, D, True) for x in p.versus.differences),
            ]
        )
    return [
        Heading(3, f"Method against method ({arm})"),
        Table(
            [
                "pair",
                "measure",
                "mean a − b",
                f"{confidence:.0%} t-interval",
                "bootstrap",
                "per seed",
            ],
            body,
            ["l", "l", "r", "r", "r", "r"],
            [
                "Every pair of maps on the same cells and images: t-interval over the per-seed differences, "
                f"bootstrap hierarchical over seeds then images ({n_resamples:,} resamples). Lower deletion "
                "AUC and higher ρ and insertion AUC are more faithful. " + CUT
            ],
            css_class="wide",
        ),
    ]


def _class_blocks(arm, cells, names, title) -> list[Block]:
    rows = controls.per_class(cells)
    classes = sorted(next(iter(rows)).per_class) if rows else []
    blocks: list[Block] = [Heading(3, f"Per class ({arm})")]
    flips = []
    for measure in MEASURES:
        these = [r for r in rows if r.measure == measure]
        body = [[f"`{r.method}`", *[fmt(r.mean(k), D, True) for k in classes]] for r in these]
        what = "ρ" if measure == "rho" else f"{WORDS[measure]} − random"
        blocks.append(
            Table(
                ["method", *[names[k] for k in classes]],
                body,
                ["l", *["r"] * len(classes)],
                [
                    f"{what} over each true class's images: mean over seeds of each seed's class mean."
                ],
                css_class="wide",
            )
        )
        for r in these:
            f = r.flips()
            if f:
                flips.append(
                    f"`{r.method}` {what}: above zero in every seed for "
                    f"{', '.join(names[k] for k in f[0])}; below zero in every seed for "
                    f"{', '.join(names[k] for k in f[1])}"
                )
        if measure == "rho":
            blocks.append(
                Figure(
                    f"per_class_rho_{arm}.png",
                    "Spearman ρ per method and true class (mean over seeds), centred on zero.",
                    report_png(
                        attribution_figures.per_class_figure(
                            np.array([[r.mean(k) for k in classes] for r in these]),
                            [r.method for r in these],
                            [names[k] for k in classes],
                            title,
                        )
                    ),
                )
            )
    blocks.append(
        Para(
            "Signs that flip across classes (every seed agreeing on each side): "
            + "; ".join(flips)
            + "."
            if flips
            else "No method's sign flips across classes with every seed agreeing on both sides."
        )
    )
    return blocks


# Said under an old check's table: what it did, against what Adebayo et al. define.
OLD_SANITY_NOTE = (
    "This evidence predates the check as Adebayo et al. define it: it randomised the blocks only, "
    "with a fresh draw at each step (not nested), and left the head, the final norm and the "
    "embeddings trained; it logged ρ alone (no absolute-value ρ, no SSIM, no independent "
    "randomisation). Scoring the study again gives the cascade from the logits down "
    "(docs/attribution.md)."
)
METRIC_WORDS = {"rho": "ρ", "abs_rho": "|ρ|", "ssim": "SSIM"}


def _sanity_blocks(arm, cells, title) -> list[Block]:
    if controls.sanity_form(cells) == "cascade":
        return _cascade_blocks(arm, cells, title)
    rows = controls.sanity(cells)
    depth = len(rows[0].per_step) if rows else 0
    body = [
        [
            f"`{r.method}`",
            *[fmt(v, D, True) for v in r.per_step],
            "⚠ survives" if r.survives else "changes",
        ]
        for r in rows
    ]
    return [
        Heading(3, f"Model-randomisation sanity check ({arm})"),
        Table(
            ["method", *[f"top {j} random" for j in range(1, depth + 1)], "verdict"],
            body,
            ["l", *["r"] * depth, "l"],
            [
                'After Adebayo et al., "Sanity Checks for Saliency Maps" (NeurIPS 2018): '
                "the blocks' parameters are replaced by seeded Gaussian noise of each tensor's own mean and SD, "
                "from the last block down, and each map is recomputed. Cell: Spearman ρ between the map of the "
                "trained model and that of the randomised one, mean over images and seeds. A map still at "
                f"ρ ≥ {SURVIVES:g} with every block random does not depend on what the model learnt (⚠)."
            ],
        ),
        Para(OLD_SANITY_NOTE),
        Figure(
            f"sanity_{arm}.png",
            "Each map's rank correlation with itself as blocks are randomised from the top (mean over seeds).",
            report_png(
                attribution_figures.sanity_figure(
                    {r.method: r.per_step for r in rows}, SURVIVES, title
                )
            ),
        ),
    ]


def _sanity_table(rows, layers, mode: str) -> Table:
    """One form's table; the cascade's ends with the verdict (rho with every layer random)."""
    cascade = mode == "cascade"
    body = [
        [f"`{r.method}` {METRIC_WORDS[r.metric]}", *[fmt(v, D, True) for v in r.per_step]]
        + (
            [("⚠ survives" if r.survives else "changes") if r.metric == "rho" else ""]
            if cascade
            else []
        )
        for r in rows
        if r.mode == mode
    ]
    header = ["map, metric", *[f"+ {name}" if cascade else name for name in layers]]
    header += ["verdict (ρ, every layer random)"] if cascade else []
    return Table(header, body, ["l", *["r"] * len(layers)] + (["l"] if cascade else []))


def _lowest(rows, method: str, metric: str) -> float:
    """The lowest value a map's metric takes at any step of either form (NaN: undefined throughout)."""
    values = [v for r in rows if (r.method, r.metric) == (method, metric) for v in r.per_step]
    finite = [v for v in values if math.isfinite(v)]
    return min(finite) if finite else math.nan


def _positive_control(arm: str, rows) -> Para:
    """What the controls must show: a weight-free map unchanged at every step, a weight-reading map moved."""
    free = [m for m in MODEL_FREE if any(r.method == m for r in rows)]
    said, ok = [], True
    for m in free:
        parts = []
        for metric in ("rho", "abs_rho", "ssim"):
            low = _lowest(rows, m, metric)
            ok = ok and (not math.isfinite(low) or low >= 1 - 1e-9)
            parts.append(
                f"{METRIC_WORDS[metric]} "
                + (fmt(low, D, True) if math.isfinite(low) else "undefined (grid below 3 x 3)")
            )
        said.append(f"`{m}` (never runs the model) at its lowest " + ", ".join(parts))
    last = {r.method: r.per_step[-1] for r in rows if (r.mode, r.metric) == ("cascade", "rho")}
    if "grad_x_input" in last:
        said.append(
            f"`grad_x_input` (reads every weight) ends at ρ {fmt(last['grad_x_input'], D, True)} "
            "with every layer random"
        )
    return Para(
        f"Positive control ({arm}): a map that does not depend on the weights must stay at 1 at "
        "every step, and one that does must fall. "
        + ("; ".join(said) if said else "No control map was scored")
        + ("." if ok else ". ⚠ a weight-free map moved: the check itself is broken.")
    )


def _cascade_blocks(arm, cells, title) -> list[Block]:
    rows = controls.sanity(cells)
    layers = controls.sanity_layers(cells)
    return [
        Heading(3, f"Model-randomisation sanity check ({arm})"),
        Para(
            'Adebayo et al., "Sanity Checks for Saliency Maps" (NeurIPS 2018). Cascading: the layers '
            "are re-initialised from the logits down, cumulatively (column `+ layer`: that layer and every "
            "one before it in the row random). Independent: one layer random, the rest trained. "
            "Re-initialisation draws once from the model's own init (a fresh model of the same config, "
            "seeded): a layer keeps its random values at every later step. Cells: the map of the "
            "randomised model against the trained model's, per image, then the mean over images and "
            "seeds: Spearman ρ, Spearman ρ of the absolute values (|ρ|), and SSIM on the patch grid "
            f"(Wang et al. 2004). A map still at ρ ≥ {SURVIVES:g} with every layer random does not "
            "depend on what the model learnt (⚠)."
        ),
        _positive_control(arm, rows),
        Para("Cascading randomisation, from the logits down:"),
        _sanity_table(rows, layers, "cascade"),
        Para("Independent randomisation, one layer at a time:"),
        _sanity_table(rows, layers, "independent"),
        Figure(
            f"sanity_{arm}.png",
            "Each map against itself as the layers are randomised: cascading (top row, from the "
            "logits down) and independent (bottom row); ρ, |ρ| and SSIM, mean over images and seeds.",
            report_png(
                attribution_figures.randomisation_figure(
                    {(r.mode, r.metric, r.method): r.per_step for r in rows},
                    layers,
                    SURVIVES,
                    title,
                )
            ),
        ),
    ]


def control_blocks(
    arm: str,
    rows: list[MeasureRow],
    cells: dict[int, AttributionCellResult],
    draws: list,
    *,
    confidence: float,
    n_resamples: int,
    seed: int,
    dataset: str | None,
    title: str,
) -> list[Block]:
    """The controls' sections of one arm (each where the cells logged what it needs)."""
    labels = sorted({int(y) for cell in cells.values() for y in cell.arrays["labels"]})
    names = class_names(dataset, labels)
    blocks: list[Block] = [Heading(2, f"Controls ({arm})")]
    oracle = _oracle_para(cells, rows)
    if oracle is not None:
        blocks.append(oracle)
    if controls.has_start(cells):
        blocks += _start_blocks(arm, cells, names)
    if draws:
        blocks += _draw_blocks(arm, cells, draws, confidence, n_resamples)
    blocks += _pair_blocks(
        arm, controls.pairwise(cells, n_resamples, confidence, seed), confidence, n_resamples
    )
    blocks += _class_blocks(arm, cells, names, f"{title}: ρ per class")
    if controls.has_sanity(cells):
        blocks += _sanity_blocks(arm, cells, f"{title}: randomisation check")
    return blocks


def draws_paragraph(arm: str, draws: list, split: str) -> Para:
    """The Results paragraph of an arm with random draws: each method against the draws' mean."""
    verdicts = {1: "more faithful than random", -1: "less faithful than random", 0: "not settled"}
    parts = {}
    for d in draws:
        better = sum(BETTER[d.measure] * x > 0 for x in d.versus.differences)
        parts.setdefault(d.method, []).append(
            f"{WORDS[d.measure]} {fmt(d.versus.mean_difference, D, True)} against the draws "
            f"({verdicts[d.settled()]}, better in {better} of {d.versus.n} seeds)"
        )
    text = ". ".join(f"`{m}`: " + "; ".join(said) for m, said in parts.items())
    return Para(
        f"**{arm}**, {split} images, each method minus the mean of the random draws: {text}."
    )


def num_classes_of(protocol, arm: str, cells: dict[int, AttributionCellResult]) -> int:
    """The acted-on model's classes (from its config; a pretrained model: the labels seen)."""
    if protocol.acts_on is not None:
        return int(protocol.model_config(arm).num_classes)
    return max(int(cell.arrays["labels"].max()) for cell in cells.values()) + 1


def dataset_of(protocol) -> str | None:
    if protocol.acts_on is not None:
        return protocol.source.dataset.name
    return protocol.pretrained.dataset
