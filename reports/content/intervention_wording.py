"""What an intervention report says about an effect, in the careful wording of ``wording.py``.

One sentence per effect, in words ("Zero-ablating head 2 of block 1 lowers validation accuracy
by 3.10 points (95% t-interval of the change ...; bootstrap ...), lower in 5 of 5 seeds; even
the wider of the two intervals, the t-interval, lies entirely below zero."), decided as
``results_paragraph`` decides (both intervals, the wider one deciding). "Lowers" and "raises"
are used only when the wider of the two intervals excludes zero; otherwise the sentence says
the seeds do not settle the sign. The resolution of the seed level is the same for every
effect of a section: ``effect_caveats`` states it once.
"""

from __future__ import annotations


from workbench.interventions.spec import (
    DropTokens,
    HeadAblation,
    PatchStage,
    SkipBranch,
    ZeroPosEmbed,
    parse,
)
from reports.content.rounding import fmt
from reports.content.wording import p_value_text, results_paragraph, section_caveats

BRANCH_WORDS = {"attn": "attention", "mlp": "MLP"}


def describe(name: str) -> str:
    """An intervention's name in words, as the subject of a sentence (lower case)."""
    if name.startswith("set."):
        return f"applying the set `{name[4:]}`"
    item = parse(name)
    if isinstance(item, HeadAblation):
        return f"{item.mode}-ablating head {item.head} of block {item.block}"
    if isinstance(item, SkipBranch):
        return f"skipping the {BRANCH_WORDS[item.branch]} branch of block {item.block}"
    if isinstance(item, ZeroPosEmbed):
        return "zeroing the position embedding"
    if isinstance(item, DropTokens):
        return (
            "dropping the register tokens"
            if item.tokens == "registers"
            else "dropping the class token"
        )
    assert isinstance(item, PatchStage)
    return f"patching `{item.stage}` with another image's activation"


def effect_paragraph(row, split: str = "validation", decimals: int = 2) -> str:
    """The stated effect of one ``summary.InterventionRow``: one sentence, then any exception ``results_paragraph`` names."""
    careful = _careful(row, split, decimals)
    c = row.paired
    what = describe(row.name)
    what = what[0].upper() + what[1:]
    mean = c.mean_difference * 100
    interval = careful.intervals.replace("t-interval", "t-interval of the change", 1)
    ties = f", {c.ties} tied" if c.ties else ""
    seeds = f"lower in {c.losses} of {c.n} seed{'s' if c.n != 1 else ''}{ties}"
    p = f"descriptive p: paired t-test {p_value_text(c.p_value)}, Wilcoxon signed-rank {p_value_text(c.wilcoxon_p_value)}"
    if careful.sign_settled and mean < 0:
        lead = (
            f"{what} lowers {split} accuracy by {fmt(-mean, decimals)} points ({interval}), {seeds}; "
            f"{careful.verdict} ({p})."
        )
    elif careful.sign_settled:
        lead = (
            f"{what} raises {split} accuracy by {fmt(mean, decimals)} points ({interval}), {seeds}; "
            f"{careful.verdict} ({p})."
        )
    else:
        lead = (
            f"{what} changes {split} accuracy by {fmt(mean, decimals, True)} points ({interval}), {seeds}; "
            f"{careful.verdict}, so these seeds do not settle whether it lowers accuracy ({p})."
        )
    # seeds missing, a note, a zero-width interval: after the result
    return " ".join([lead, *careful.exceptions])


def effect_caveats(rows, split: str = "validation") -> str:
    """The caveats the effects of ``rows`` share (the seed level's resolution, the p-values' status), once."""
    return section_caveats(_careful(r, split) for r in rows)


def _careful(row, split: str, decimals: int = 2):
    return results_paragraph(
        row.paired,
        row.bootstrap,
        a_label=f"`{row.name}`",
        b_label="`intact`",
        split=split,
        decimals=decimals,
    )


def heads_sentence(rows, mode: str, split: str = "validation", small: float = 1.0) -> str:
    """How many heads matter: the count within ``small`` points on average, and the settled drops, named."""
    heads = [r for r in rows if isinstance(r.item, HeadAblation) and r.item.mode == mode]
    if not heads:
        return ""
    near = [r for r in heads if abs(r.paired.mean_difference * 100) < small]
    settled = []
    for r in heads:
        p = results_paragraph(r.paired, r.bootstrap, split=split)
        if p.sign_settled and r.paired.mean_difference < 0:
            settled.append(r)
    settled.sort(key=lambda r: r.paired.mean_difference)
    named = ", ".join(
        f"`{r.name}` ({fmt(r.paired.mean_difference * 100, 2, True)})" for r in settled
    )
    n = heads[0].paired.n
    text = (
        f"{mode.capitalize()}-ablating one head at a time: {len(near)} of {len(heads)} heads change {split} "
        f"accuracy by less than {small:g} point{'s' if small != 1 else ''} on average over {n} "
        f"seed{'s' if n != 1 else ''}; "
    )
    if settled:
        text += (
            f"for {len(settled)} the wider of the two 95% intervals lies entirely below zero (a drop these seeds "
            f"settle): {named}."
        )
    else:
        text += "for none does the wider of the two 95% intervals lie entirely below zero."
    return text + " " + per_seed_heads(heads, split, small)


def per_seed_heads(heads, split: str, small: float) -> str:
    """Model by model: how many heads cost less than ``small`` points alone, and the largest single-head drop.

    Index-free: the heads of separately trained seeds do not correspond by index, so this is
    the comparison with "most heads can be removed, a few cannot" that holds in each model.
    """
    seeds = sorted(heads[0].intact)
    change = {s: [(r.intervened[s] - r.intact[s]) * 100 for r in heads] for s in seeds}
    within = [sum(abs(c) < small for c in change[s]) for s in seeds]
    worst = [min(change[s]) for s in seeds]
    if len(seeds) == 1:
        return (
            f"In this model {within[0]} of {len(heads)} heads cost less than {small:g} point{'s' if small != 1 else ''} "
            f"when removed alone; the largest single-head drop is {fmt(-worst[0], 2)} points."
        )
    return (
        f"Model by model (heads of separately trained seeds do not correspond by index, so this is the comparison "
        f"that needs no alignment): {', '.join(map(str, within))} of {len(heads)} heads cost less than {small:g} "
        f"point{'s' if small != 1 else ''} when removed alone, and the largest single-head drop is "
        f"{', '.join(fmt(-w, 2) for w in worst)} points (seeds {', '.join(map(str, seeds))})."
    )
