"""The "Scored images" table every acting kind's report shares: images per class per cell, and its warnings.

A kind reads its cells' class counts (``workbench.sample.ClassCounts``: every class of the
evaluated split, an absent one with a count of 0) and words what the images are; this module
draws the table (a row per arm and seed, a column per class, or the fewest and most per class
where there are many classes) and says, once per arm where the seeds' counts agree, why a
sample misses a class of the data or holds fewer than ``workbench.sample.MIN_PER_CLASS`` of
one. Those lines are the report's warnings, and ``workbench report --strict`` refuses them.
"""

from __future__ import annotations

from collections.abc import Callable

from reports.common.report_parts import FLAG
from reports.render import Para, Table
from workbench.sample import MIN_PER_CLASS, ClassCounts

MOST_COLUMNS = 20  # classes shown one per column; more are summarised (lowest, highest count)


def sample_problems(arm: str, counts: dict[int, ClassCounts]) -> list[str]:
    """One line per problem of the arm's sample (the seeds' samples are the same: said once)."""
    distinct = {tuple(c.counts) for c in counts.values()}
    seeds = sorted(counts)
    problems = []
    for seed in seeds if len(distinct) > 1 else seeds[:1]:
        who = f"{arm}/seed{seed}" if len(distinct) > 1 else arm
        problems += [
            f"{who}: {p}: the scored images do not speak for every class of the data"
            for p in counts[seed].problems(MIN_PER_CLASS)
        ]
    return problems


def counts_table(
    arms: list[tuple[str, dict[int, ClassCounts]]], caption: Callable[[int], str]
) -> tuple[Table | None, list[str]]:
    """The class counts of every arm's cells as a table (None when there are no cells), and the
    arms' problems (``sample_problems``); ``caption(number of classes)`` is its caption."""
    rows, problems, classes = [], [], None
    for arm, counts in arms:
        problems += sample_problems(arm, counts)
        for seed, c in counts.items():
            classes = c.classes if classes is None else classes
            shown = (
                [str(int(n)) for n in c.counts]
                if len(c.classes) <= MOST_COLUMNS
                else [str(int(c.counts.min())), str(int(c.counts.max()))]
            )
            rows.append([arm, str(seed), *shown, str(int(c.counts.sum()))])
    if classes is None:
        return None, []
    header = (
        [f"class {int(c)}" for c in classes]
        if len(classes) <= MOST_COLUMNS
        else ["fewest per class", "most per class"]
    )
    table = Table(
        ["arm", "seed", *header, "images"],
        rows,
        ["l", "r", *["r"] * (len(header) + 1)],
        [caption(len(classes))],
    )
    return table, problems


def problems_para(problems: list[str]) -> Para:
    """The warning under the table: what is too thin, and that ``--strict`` refuses the study."""
    return Para(
        f"{FLAG} "
        + "; ".join(problems)
        + ". Every number below is about these images only; `workbench report --strict` "
        "refuses this study."
    )
