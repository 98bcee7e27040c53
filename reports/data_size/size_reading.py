"""The numbers of the Data size section, computed from a ``StudyData``.

Present only for a protocol whose arms vary ``dataset.train_subset``
(``reports.content.data_size.varies_size``). Arms group into families
(``group_families``: the same overrides but ``train_subset``); each family is compared with the
reference arm's family, a minus b paired by seed: at every N both trained on, the gap with its
t-interval over seeds (``workbench.stats.paired_seed_comparison``, as the report's comparisons);
at 3 or more such N the slope of the gap against log10 N (``gap_slope``: per seed, then over
seeds); at exactly 2, the interaction (a - b at the smaller N) - (a - b at the larger N) through
the report's interaction machinery (``reports.tables.interaction``: t-interval and the
four-arm hierarchical bootstrap).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reports import tables
from reports.collect import StudyData
from workbench import stats
from reports.content.data_size import (
    Family,
    GapSlope,
    compared_pairs,
    gap_slope,
    group_families,
    shared_sizes,
    size_text,
    varies_size,
)


@dataclass(frozen=True)
class SizeGap:
    """a - b at one N, paired by seed (None: no seed has both arms)."""

    n: int
    a: str  # arm of family a at this N
    b: str
    paired: stats.PairedComparison | None


@dataclass(frozen=True)
class FamilyPair:
    """Family a against family b (the reference's) at the sizes both trained on."""

    a: Family
    b: Family
    sizes: tuple[int, ...]
    gaps: list[SizeGap]
    slope: GapSlope | None = None  # 3 or more sizes
    interaction: tables.Interaction | None = None  # exactly 2 sizes
    note: str = ""


@dataclass(frozen=True)
class SizeReading:
    """The Data size section's numbers on one split."""

    split: str
    families: list[Family]
    values: dict[str, dict[int, float]]  # arm -> seed -> accuracy (finished seeds)
    pairs: list[FamilyPair]
    notes: list[str] = field(default_factory=list)  # arms left out, and why


def cell_params(study: StudyData) -> dict[str, list[dict[str, str]]]:
    """Arm -> the logged params of its reported cells, in seed order."""
    out: dict[str, list[dict[str, str]]] = {}
    for (arm, _), cell in sorted(study.cells.items(), key=lambda kv: kv[0][1]):
        out.setdefault(arm, []).append(cell.record.params)
    return out


def size_reading(
    study: StudyData, split: str, n_resamples: int = tables.BOOTSTRAP_RESAMPLES
) -> SizeReading | None:
    """The reading on ``split``; None for a protocol whose arms all train on one size."""
    canonical = study.spec.canonical
    if not canonical or not varies_size(canonical):
        return None
    families, notes = group_families(canonical, cell_params(study))
    values = {arm: tables.arm_summary(study, arm, split).values for arm in study.spec.arms}
    pairs = [_pair(study, a, b, values, split, n_resamples) for a, b in compared_pairs(families)]
    return SizeReading(split, families, values, pairs, notes)


def _pair(
    study: StudyData,
    a: Family,
    b: Family,
    values: dict[str, dict[int, float]],
    split: str,
    n_resamples: int,
) -> FamilyPair:
    sizes = shared_sizes(a, b)
    gaps = [_gap(n, a.arms[n], b.arms[n], values) for n in sizes]
    if len(sizes) < 2:
        shared = ", ".join(size_text(n) for n in sizes) or "none"
        return FamilyPair(a, b, sizes, gaps, note=f"sizes shared with {b.name}: {shared}")
    if len(sizes) == 2:
        small, large = sizes
        quad = (a.arms[small], b.arms[small], a.arms[large], b.arms[large])
        return FamilyPair(
            a, b, sizes, gaps, interaction=tables.interaction(study, quad, split, n_resamples)
        )
    by_size_a = {n: values[a.arms[n]] for n in sizes}
    by_size_b = {n: values[b.arms[n]] for n in sizes}
    try:
        slope = gap_slope(by_size_a, by_size_b, sizes, tables.CONFIDENCE)
    except ValueError as err:  # no seed has every size: say so, keep the gaps
        return FamilyPair(a, b, sizes, gaps, note=f"no slope: {err}")
    return FamilyPair(a, b, sizes, gaps, slope=slope)


def _gap(n: int, a: str, b: str, values: dict[str, dict[int, float]]) -> SizeGap:
    if not set(values[a]) & set(values[b]):
        return SizeGap(n, a, b, None)
    paired = stats.paired_seed_comparison(
        values[a], values[b], tables.CONFIDENCE, allow_missing=True, names=(a, b)
    )
    return SizeGap(n, a, b, paired)
