"""Which images an attribution study scored, per class, and whether they can speak for the data.

Every cell of an arm scores the same images (the pairing), so the class counts are read per arm
from its cells' labels. The classes of the data are the evaluated split's, which a cell exported
since the sample rule existed records (``sample_classes``, ``class_counts``: an absent class has
a count of 0); an older export has only the labels, and then the classes are the acted-on
model's (``control_blocks.num_classes_of``). A sample that misses a class of the data, or holds
fewer than ``workbench.sample.MIN_PER_CLASS`` images of one, gets a warning in the section, and
``workbench report --strict`` refuses the study.
"""

from __future__ import annotations

import numpy as np

from reports.attribution.control_blocks import num_classes_of
from reports.common.scored_images import counts_table, problems_para
from reports.render import Block, Heading
from tracking.kinds.attribution_runs import AttributionCellResult
from workbench.protocol import AttributionProtocol
from workbench.sample import MIN_PER_CLASS, ClassCounts, class_counts


def cell_counts(cell: AttributionCellResult, num_classes: int) -> ClassCounts:
    """The cell's scored images per class of the data (the recorded classes, else ``0..num_classes-1``)."""
    a = cell.arrays
    classes = a["sample_classes"] if "sample_classes" in a else np.arange(num_classes)
    return class_counts(a["labels"], classes)


def sample_words(protocol: AttributionProtocol) -> str:
    """How the protocol chose its images, in words."""
    s = protocol.settings
    return {
        "first": f"the first {s.images:,} images of the split in its order (a source stored by class "
        "gives the first classes only)",
        "stratified": f"a class-stratified sample of {s.images:,} (seed {s.sample_seed}: equal counts "
        "per class where the number allows, the rest one each to classes in a seeded order)",
        "indices": f"the {s.images:,} positions the protocol names",
    }[s.sample]


def arm_counts(
    protocol: AttributionProtocol, arm: str, cells: dict[int, AttributionCellResult]
) -> dict[int, ClassCounts]:
    """Per seed, the arm's scored images per class."""
    recorded = all("sample_classes" in c.arrays for c in cells.values())
    n = 0 if recorded else num_classes_of(protocol, arm, cells)
    return {seed: cell_counts(c, n) for seed, c in sorted(cells.items())}


def sample_blocks(
    protocol: AttributionProtocol, arms: list[tuple[str, dict[int, AttributionCellResult]]]
) -> tuple[list[Block], list[str]]:
    """The "Scored images" section (a row of class counts per arm, or per seed where they differ) and
    the problems ``--strict`` refuses."""
    table, problems = counts_table(
        [(arm, arm_counts(protocol, arm, cells)) for arm, cells in arms],
        lambda k: (
            f"Scored images per class of the evaluated split ({k} classes), per cell: "
            f"{sample_words(protocol)}. A class with none, or with fewer than {MIN_PER_CLASS}, is "
            "too thin for a per-class reading or a mean that stands for the data."
        ),
    )
    if table is None:
        return [], []
    blocks: list[Block] = [Heading(2, "Scored images"), table]
    if problems:
        blocks.append(problems_para(problems))
    return blocks, problems
