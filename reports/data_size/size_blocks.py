"""The Data size section rendered: per split, the accuracy table, the figure, each family pair.

Every displayed per-seed value is the accuracy table's (the split's decimals), and each
displayed per-seed gap is the difference of displayed values, as in the report's other tables;
means, intervals and slopes come from the unrounded values. A sign is settled where the
t-interval excludes zero (the rule the claims check applies); the 2-size interaction follows the
report's interaction rule (the wider of its t-interval and bootstrap decides), as its sentence does.
"""

from __future__ import annotations

import math

import matplotlib
from matplotlib.figure import Figure as MplFigure

from reports import tables
from reports.data_size.size_reading import FamilyPair, SizeGap, SizeReading
from reports.figures import STYLE, report_png
from reports.render import Block, Figure, Heading, Para, Quote, Table
from reports.content import interaction
from reports.content.data_size import settled, size_text, t_multiplier
from reports.content.rounding import fmt, paired_display

SPLIT_WORDS = {"val": "validation", "test": "test"}
SPLIT_TITLES = {"val": "Validation", "test": "Test"}
FLAG = "⚠"


def data_size_section(
    readings: dict[str, SizeReading | None], decimals: dict[str, int], seeds: tuple[int, ...]
) -> list[Block]:
    """The section (empty when no split has a reading: a protocol that trains on one size)."""
    present = {split: r for split, r in readings.items() if r is not None}
    if not present:
        return []
    first = next(iter(present.values()))
    blocks: list[Block] = [Heading(2, "Data size"), Para(_intro(first))]
    blocks += [Para(f"{FLAG} {note}.") for note in first.notes]
    for split, reading in present.items():
        blocks += [Heading(3, SPLIT_TITLES[split]), accuracy_table(reading, decimals[split], seeds)]
        blocks.append(
            Figure(
                f"data_size_{split}.png",
                (
                    f"{SPLIT_TITLES[split]} accuracy against the number of training images N (log axis): "
                    "one line per family through its means over seeds, a dot per seed."
                ),
                size_figure(reading),
            )
        )
        for pair in reading.pairs:
            blocks += pair_blocks(pair, reading, decimals[split], seeds)
    return blocks


def _intro(reading: SizeReading) -> str:
    families = "; ".join(
        f"{f.name}{' (the reference)' if f.reference else ''}: {', '.join(f.arms.values())}"
        for f in reading.families
    )
    return (
        "Arms grouped into families: arms whose hashed overrides are the same once "
        "`dataset.train_subset` is left out. N is an arm's `dataset.train_subset`, or, where it has none, "
        "the size of the whole training split its cells logged (`data.train_images`). Every arm is "
        "evaluated on the same examples and paired by seed. Each family is compared with the "
        f"reference's family, a − b in points. Families: {families}."
    )


def accuracy_table(reading: SizeReading, decimals: int, seeds: tuple[int, ...]) -> Table:
    """One row per family and N: the arm, its accuracy per seed and the mean over seeds (%)."""
    body = []
    for family in reading.families:
        for n, arm in family.arms.items():
            values = reading.values.get(arm, {})
            mean = fmt(100 * sum(values.values()) / len(values), decimals) if values else "missing"
            per_seed = [fmt(100 * values[s], decimals) if s in values else "missing" for s in seeds]
            body.append([family.name, size_text(n), arm, *per_seed, mean])
    return Table(
        ["family", "N", "arm", *[f"seed {s}" for s in seeds], "mean"],
        body,
        ["l", "r", "l", *["r"] * len(seeds), "r"],
        [f"{SPLIT_TITLES[reading.split]} accuracy (%) per seed; mean over the finished seeds."],
    )


def size_figure(reading: SizeReading) -> bytes:
    """Accuracy against N on a log axis: a line per family through its means, a dot per seed."""
    colors = matplotlib.colormaps["tab10"]
    sizes = sorted({n for f in reading.families for n in f.sizes})
    with matplotlib.rc_context(STYLE):
        fig = MplFigure(figsize=(6.0, 3.8), layout="constrained")
        ax = fig.subplots()
        for i, family in enumerate(reading.families):
            color = colors(i % 10)
            xs, means = [], []
            for n, arm in family.arms.items():
                values = list(reading.values.get(arm, {}).values())
                if not values:
                    continue
                ax.scatter(
                    [n] * len(values), [100 * v for v in values], color=color, s=12, alpha=0.6
                )
                xs.append(n)
                means.append(100 * sum(values) / len(values))
            ax.plot(xs, means, color=color, marker="o", lw=1.5, label=family.name)
        ax.set_xscale("log")
        ax.set_xticks(sizes, [size_text(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("training images N (log scale)")
        ax.set_ylabel(f"{SPLIT_WORDS[reading.split]} accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        return report_png(fig)


def _interval(low: float, high: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return f"[{fmt(100 * low, 2, True)}, {fmt(100 * high, 2, True)}]" + (
        f" {FLAG}" if low == high else ""
    )


def _sign(low: float, high: float, positive: str, negative: str) -> str:
    verdict = settled(low, high)
    if verdict is None:
        finite = math.isfinite(low) and math.isfinite(high)
        return "n/a (zero width: no spread)" if finite else "n/a (no interval)"
    if verdict:
        return f"settled: {positive if low > 0 else negative} (t-interval excludes 0)"
    return "not settled (t-interval includes 0)"


def pair_blocks(
    pair: FamilyPair, reading: SizeReading, decimals: int, seeds: tuple[int, ...]
) -> list[Block]:
    """The gap at each shared N, then the slope (3+ sizes) or the interaction (2 sizes)."""
    a, b = pair.a.name, pair.b.name
    body = [_gap_row(g, reading, decimals, seeds, (a, b)) for g in pair.gaps]
    notes = [
        f"{a} − {b} at each N both trained on, per seed from the displayed accuracies; mean and "
        f"{tables.CONFIDENCE:.0%} Student-t interval over seeds (df = n − 1) from the unrounded values. "
        "Sign: settled where the t-interval excludes zero (the rule the claims check applies to the README)."
    ]
    quotes: list[Block] = []
    if pair.slope is not None:
        body.append(_slope_row(pair, seeds))
        notes.append(_slope_method(pair))
        quotes.append(Quote(slope_sentence(pair, reading.split)))
    elif pair.interaction is not None:
        row, text, ix_notes = _interaction_row(pair, decimals, seeds)
        body.append(row)
        notes += ix_notes
        if text:
            quotes.append(Quote(text))
    if pair.note:
        notes.append(f"{FLAG} {a} − {b}: {pair.note}.")
    table = Table(
        ["N", "a − b", *[f"seed {s}" for s in seeds], "mean", "95% t-interval", "sign"],
        body,
        ["r", "l", *["r"] * len(seeds), "r", "r", "l"],
        notes,
    )
    return [Heading(4, f"{a} − {b}"), table, *quotes]


def _gap_row(
    g: SizeGap,
    reading: SizeReading,
    decimals: int,
    seeds: tuple[int, ...],
    families: tuple[str, str],
) -> list[str]:
    """One N: per-seed gaps from the displayed accuracies, the mean and t-interval, the sign."""
    a, b = families
    label = f"{g.a} − {g.b}"
    if g.paired is None:
        return [size_text(g.n), label, *["missing"] * len(seeds), "n/a", "n/a", "n/a"]
    p = g.paired
    shown = paired_display(
        [reading.values[g.a][s] for s in p.seeds],
        [reading.values[g.b][s] for s in p.seeds],
        100.0,
        decimals,
    )
    diffs = dict(zip(p.seeds, shown.differences))
    return [
        size_text(g.n),
        label,
        *[diffs.get(s, "missing") for s in seeds],
        fmt(100 * p.mean_difference, 2, True),
        _interval(p.ci_low, p.ci_high),
        _sign(p.ci_low, p.ci_high, f"{a} ahead", f"{b} ahead"),
    ]


def _slope_row(pair: FamilyPair, seeds: tuple[int, ...]) -> list[str]:
    s = pair.slope
    o = s.over_seeds
    return [
        "slope",
        "per tenfold N",
        *[fmt(100 * s.per_seed[x], 2, True) if x in s.per_seed else "missing" for x in seeds],
        fmt(100 * o.mean_difference, 2, True),
        _interval(o.ci_low, o.ci_high),
        _sign(o.ci_low, o.ci_high, "rises with N", "falls with N"),
    ]


def _slope_method(pair: FamilyPair) -> str:
    n = pair.slope.over_seeds.n
    t = t_multiplier(n, tables.CONFIDENCE)
    width = (
        f"With {n} seeds the interval spans ±{t:.2f} standard errors of the mean slope "
        f"(t quantile, df = {n - 1}): it settles a sign only where the seeds' slopes agree closely."
        if n >= 2
        else "With one seed there is no spread, so no interval."
    )
    left = "".join(
        f" Seed {s} has no slope: it lacks N = {', '.join(size_text(x) for x in lacking)}."
        for s, lacking in pair.slope.left_out.items()
    )
    return (
        f"Slope: per seed, the least-squares slope of {pair.a.name} − {pair.b.name} against log10 N over "
        f"N = {', '.join(size_text(x) for x in pair.sizes)} (points per tenfold N); then the mean of the "
        f"{n} seeds' slopes with its {tables.CONFIDENCE:.0%} Student-t interval over seeds. {width} "
        "The seeds are the only spread it counts: one seed's points share its initialisation and data order."
        + left
    )


def slope_sentence(pair: FamilyPair, split: str) -> str:
    """The stated result of a slope: its number, its interval over n seeds, settled or not."""
    o = pair.slope.over_seeds
    a, b, n = pair.a.name, pair.b.name, o.n
    lead = (
        f"On {SPLIT_WORDS[split]}, {a} − {b} changes by {fmt(100 * o.mean_difference, 2, True)} points "
        f"per tenfold N from N = {size_text(pair.sizes[0])} to {size_text(pair.sizes[-1])} "
        f"(mean over {n} seeds of each seed's least-squares slope against log10 N; "
        f"{tables.CONFIDENCE:.0%} t-interval {_interval(o.ci_low, o.ci_high)})"
    )
    negative = f"negative in {o.losses} of {n} seeds"
    verdict = settled(o.ci_low, o.ci_high)
    if verdict is None:
        return f"{lead}; no interval ({o.note or 'no spread'}), so these seeds cannot say how it moves with N."
    if verdict:
        way = "falls as N grows (larger on fewer images)" if o.ci_high < 0 else "rises as N grows"
        return f"{lead}; the interval excludes zero: settled, {a} − {b} {way}; the slope is {negative}."
    return (
        f"{lead}; the interval includes zero: not settled, these {n} seeds do not say whether "
        f"{a} − {b} rises or falls with N (the slope is {negative})."
    )


def _interaction_row(pair: FamilyPair, decimals: int, seeds: tuple[int, ...]):
    ix = pair.interaction
    label = f"N {size_text(pair.sizes[0])} − N {size_text(pair.sizes[1])}"
    if ix.paired is None:
        return (
            [label, "interaction", *["missing"] * len(seeds), "n/a", "n/a", "n/a"],
            "",
            [f"{FLAG} {interaction.interaction_label(ix.arms)}: {ix.note}"],
        )
    ic = interaction.interaction_content(
        ix.paired,
        ix.bootstrap,
        ix.values,
        ix.arms,
        split=SPLIT_WORDS[ix.split],
        expected_n=ix.expected_n,
        decimals=decimals,
    )
    p, par = ix.paired, ic.paragraph
    per_seed = dict(zip(ic.seeds, ic.per_seed))
    if par.sign_settled:
        at = pair.sizes[0] if p.mean_difference > 0 else pair.sizes[1]
        sign = (
            f"settled: {pair.a.name} − {pair.b.name} larger at N = {size_text(at)} "
            f"({par.driving_interval} excludes 0)"
        )
    elif par.sign_settled is False:
        sign = f"not settled ({par.driving_interval} includes 0)"
    else:
        sign = "n/a (no interval)"
    notes = [
        f"Interaction: {ic.label}, per seed from the displayed accuracies: whether {pair.a.name} − "
        f"{pair.b.name} differs between the smaller and the larger N. Its sign follows the report's "
        "interaction rule (the wider of the t-interval and the hierarchical bootstrap decides)."
    ]
    if ic.bootstrap is not None:
        notes.append(
            f"{ic.label}: 95% bootstrap [{ic.bootstrap.low}, {ic.bootstrap.high}]; {ic.bootstrap.footnote}."
        )
    notes += [f"{ic.label}: {x}" for x in (p.note, ix.note) if x]
    row = [
        label,
        "interaction",
        *[per_seed.get(s, "missing") for s in seeds],
        fmt(100 * p.mean_difference, 2, True),
        _interval(p.ci_low, p.ci_high),
        sign,
    ]
    return row, ic.text, notes
