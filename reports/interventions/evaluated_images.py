"""Which images an intervention study evaluated, per class: the whole split, and patching's clean images.

Every intervention is applied to every image of the evaluated split; patching pairs a sample
of them (``workbench.interventions.patching.make_pairs``). A cell logged since the counts
existed records both per class of the split (``per_example.npz`` and ``patching.npz``:
``sample_classes``, ``class_counts``); the "Scored images" section draws them with the
attribution report's table (``reports.common.scored_images``), warns where a class of the data
is missing or has fewer than ``MIN_PER_CLASS`` images, and ``--strict`` refuses that. A cell
logged before has no counts, and a table whose cells lack them is left out: a report rebuilt
from such evidence has no such section, as it had none when it was published.
"""

from __future__ import annotations

from reports.common.report_parts import SPLIT_WORDS
from reports.common.scored_images import counts_table, problems_para
from reports.render import Block, Heading
from tracking.kinds.intervention_runs import InterventionCellResult
from workbench.protocol import InterventionProtocol
from workbench.sample import MIN_PER_CLASS, ClassCounts

Cells = dict[int, InterventionCellResult]
THIN = (
    f"A class with none, or with fewer than {MIN_PER_CLASS}, is too thin for a per-class reading "
    "or a mean that stands for the data."
)


def pairs_words(protocol: InterventionProtocol) -> str:
    """How the protocol drew patching's clean images, in words."""
    p = protocol.patching
    return {
        "uniform": f"{p.pairs:,} positions drawn uniformly (seed {p.seed}; the rule of the "
        "protocols frozen before the stratified sample: the counts per class are as the draw fell)",
        "stratified": f"a class-stratified sample of {p.pairs:,} (seed {p.seed}: equal counts per "
        "class where the number allows, the rest one each to classes in a seeded order)",
    }[p.sample]


def _split_counts(cells: Cells) -> dict[int, ClassCounts] | None:
    counts = {s: c.counts for s, c in sorted(cells.items())}
    return counts if counts and all(c is not None for c in counts.values()) else None


def _pair_counts(cells: Cells) -> dict[int, ClassCounts] | None:
    arrays = {s: c.patching for s, c in sorted(cells.items())}
    if not arrays or any(a is None or "class_counts" not in a for a in arrays.values()):
        return None
    return {s: ClassCounts(a["sample_classes"], a["class_counts"]) for s, a in arrays.items()}


def scored_blocks(
    protocol: InterventionProtocol, arms: list[tuple[str, Cells]]
) -> tuple[list[Block], list[str]]:
    """The "Scored images" section (empty when no cell logged counts) and the problems ``--strict`` refuses."""
    split = SPLIT_WORDS[protocol.evaluation.split]
    blocks: list[Block] = []
    problems: list[str] = []
    evaluated = [(arm, c) for arm, cells in arms if (c := _split_counts(cells)) is not None]
    table, found = counts_table(
        evaluated,
        lambda k: (
            f"Evaluated images per class of the {split} split ({k} classes), per cell: the whole "
            f"split (every intervention is applied to every image). {THIN}"
        ),
    )
    if table is not None:
        blocks.append(table)
        problems += found
    if protocol.patching is not None:
        paired = [(arm, c) for arm, cells in arms if (c := _pair_counts(cells)) is not None]
        table, found = counts_table(
            paired,
            lambda k: (
                f"Clean images of the patching pairs per class of the {split} split ({k} classes), "
                f"per cell: {pairs_words(protocol)}. {THIN}"
            ),
        )
        if table is not None:
            blocks.append(table)
            problems += [f"patching pairs: {p}" for p in found]
    if not blocks:
        return [], []
    blocks.insert(0, Heading(2, "Scored images"))
    if problems:
        blocks.append(problems_para(problems))
    return blocks, problems
