"""The data-size reading: arms grouped into families by everything but their training-set size.

A protocol whose arms vary ``dataset.train_subset`` trains the same configurations on nested
training sets of N images. Its arms form families: the arms whose hashed overrides are the same
once ``dataset.train_subset`` is left out (``group_families``). An arm's N is its
``train_subset``, or the size of the whole training split when it has none, read from its
cells' logged ``data.train_images`` (the split's size as the run carved it).

Two families compared (a minus b, paired by seed) at the sizes both trained on:

- at 3 or more sizes, the slope of a - b against log10 N: each seed's least-squares slope
  (``seed_slope``), then their mean with a Student-t interval over seeds (``gap_slope``, through
  ``workbench.stats.paired_seed_comparison`` of the slopes against zero);
- at 2 sizes, the interaction (a - b at the smaller N) - (a - b at the larger N), which the
  report computes with the ablation report's interaction machinery.

Whether an interval settles a sign (``settled``) is the rule of the claims check
(``reports/published/claims.py``: settled where the interval excludes zero), so a sentence in
the README that quotes the reading is checked by the rule the report used. The report
(``reports/data_size/``) and the claims' computations (``data_size_gap``,
``data_size_slope``, ``data_size_interaction``) both read families, sizes and slopes here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.stats

from workbench import stats

SIZE_KEY = "train_subset"
LOGGED_SUBSET = "data.train_subset"
LOGGED_TRAIN_IMAGES = "data.train_images"


@dataclass(frozen=True)
class Family:
    """Arms that differ only in their training-set size: N -> arm, by N ascending."""

    name: str
    arms: dict[int, str]
    reference: bool  # holds the protocol's reference arm

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.arms)


@dataclass(frozen=True)
class GapSlope:
    """The slope of a - b against log10 N, per seed and over seeds.

    Slopes are in the values' unit per tenfold N (accuracies as fractions: fraction per decade).
    ``over_seeds`` is the slopes against zero: its mean, t-interval, wins (seeds with a positive
    slope) and losses are the slope's.
    """

    sizes: tuple[int, ...]
    per_seed: dict[int, float]  # seed -> least-squares slope over ``sizes``
    over_seeds: stats.PairedComparison
    left_out: dict[int, list[int]]  # seed -> sizes it lacks (such a seed has no slope)


def subset_of(canonical: Mapping[str, Any], arm: Mapping[str, Any]) -> int | None:
    """The arm's resolved ``dataset.train_subset``: its override, else the protocol's, else None."""
    overridden = arm.get("overrides", {}).get("dataset", {})
    if SIZE_KEY in overridden:
        return overridden[SIZE_KEY]
    return canonical.get("dataset", {}).get(SIZE_KEY)


def varies_size(canonical: Mapping[str, Any]) -> bool:
    """Whether the protocol's arms train on more than one ``dataset.train_subset`` (null counts)."""
    arms = canonical.get("arms", [])
    return len({subset_of(canonical, a) for a in arms}) > 1


def family_key(arm: Mapping[str, Any]) -> str:
    """The arm's overrides without ``dataset.train_subset``, as canonical JSON."""
    overrides = {k: dict(v) for k, v in arm.get("overrides", {}).items()}
    overrides.get("dataset", {}).pop(SIZE_KEY, None)
    return json.dumps({k: v for k, v in overrides.items() if v}, sort_keys=True)


def arm_size(
    subset: int | None, params: Sequence[Mapping[str, str]], fallback: int | None
) -> tuple[int | None, str]:
    """An arm's N and, when it has none, why.

    Args:
        subset: The arm's resolved ``train_subset`` (None: the whole training split).
        params: The logged params of the arm's reported cells.
        fallback: The protocol's ``dataset.train_size``, for an arm with no cell yet.
    """
    if subset is not None:
        logged = {p[LOGGED_SUBSET] for p in params if LOGGED_SUBSET in p}
        if logged - {str(subset)}:
            return (
                None,
                f"its cells logged {LOGGED_SUBSET} = {', '.join(sorted(logged))}, not {subset}",
            )
        return int(subset), ""
    logged = {p[LOGGED_TRAIN_IMAGES] for p in params if LOGGED_TRAIN_IMAGES in p}
    if len(logged) > 1:
        return (
            None,
            f"its cells logged different {LOGGED_TRAIN_IMAGES}: {', '.join(sorted(logged))}",
        )
    if logged:
        return int(float(logged.pop())), ""
    if fallback is not None:
        return int(fallback), ""
    return None, f"no cell logged {LOGGED_TRAIN_IMAGES} and the protocol sets no dataset.train_size"


def family_name(arms: Mapping[int, str]) -> str:
    """The members' common name once each one's size is cut off its end (``vit_2500`` -> ``vit``)."""
    stems = set()
    for n, arm in arms.items():
        stem = arm
        for suffix in (f"_{n}", f"-{n}", str(n)):
            if arm.endswith(suffix) and len(arm) > len(suffix):
                stem = arm[: -len(suffix)]
                break
        stems.add(stem)
    if len(stems) == 1:
        return stems.pop()
    prefix = _common_prefix(sorted(stems)).rstrip("_-. ")
    return prefix or arms[max(arms)]


def _common_prefix(names: list[str]) -> str:
    first, last = names[0], names[-1]
    i = 0
    while i < min(len(first), len(last)) and first[i] == last[i]:
        i += 1
    return first[:i]


def group_families(
    canonical: Mapping[str, Any], params: Mapping[str, Sequence[Mapping[str, str]]]
) -> tuple[list[Family], list[str]]:
    """The protocol's families (in the order of their first arm) and notes on arms left out.

    Args:
        canonical: The protocol's hashed content.
        params: Arm -> the logged params of its reported cells.
    """
    fallback = canonical.get("dataset", {}).get("train_size")
    members: dict[str, dict[int, str]] = {}
    reference: set[str] = set()
    notes = []
    for arm in canonical.get("arms", []):
        name = arm["name"]
        n, why = arm_size(subset_of(canonical, arm), params.get(name, []), fallback)
        if n is None:
            notes.append(f"{name} left out: {why}")
            continue
        key = family_key(arm)
        family = members.setdefault(key, {})
        if n in family:
            notes.append(f"{name} left out: {family[n]} of the same family trains on N = {n} too")
            continue
        family[n] = name
        if arm.get("reference"):
            reference.add(key)
    families, seen = [], set()
    for key, arms in members.items():
        ordered = dict(sorted(arms.items()))
        name = family_name(ordered)
        if name in seen:
            name = f"{name} ({ordered[max(ordered)]})"
        seen.add(name)
        families.append(Family(name, ordered, key in reference))
    return families, notes


def compared_pairs(families: Sequence[Family]) -> list[tuple[Family, Family]]:
    """Every family against the reference's family (a - b with b the reference's), in family order."""
    base = next((f for f in families if f.reference), None)
    if base is None:
        return []
    return [(f, base) for f in families if f is not base]


def shared_sizes(a: Family, b: Family) -> tuple[int, ...]:
    return tuple(sorted(set(a.sizes) & set(b.sizes)))


def seed_slope(sizes: Sequence[int], gaps: Sequence[float]) -> float:
    """Least-squares slope of ``gaps`` against log10 of ``sizes``: sum(dx dy) / sum(dx^2)."""
    x = np.log10(np.asarray(sizes, dtype=np.float64))
    y = np.asarray(gaps, dtype=np.float64)
    dx = x - x.mean()
    return float((dx * (y - y.mean())).sum() / (dx * dx).sum())


def gap_slope(
    a: Mapping[int, Mapping[int, float]],
    b: Mapping[int, Mapping[int, float]],
    sizes: Sequence[int],
    confidence: float = 0.95,
) -> GapSlope:
    """The slope of a - b against log10 N per seed, then over seeds.

    Args:
        a, b: N -> seed -> value of the two families' arms.
        sizes: The sizes both trained on (3 or more).
        confidence: Two-sided level of the t-interval over seeds.

    Raises:
        ValueError: Fewer than 3 sizes, or no seed with a value of both families at every size.
    """
    if len(sizes) < 3:
        raise ValueError(f"a slope needs 3 or more sizes, got {list(sizes)}")
    seeds = sorted({s for n in sizes for s in (*a.get(n, {}), *b.get(n, {}))})
    per_seed, left_out = {}, {}
    for s in seeds:
        lacking = [n for n in sizes if s not in a.get(n, {}) or s not in b.get(n, {})]
        if lacking:
            left_out[s] = lacking
            continue
        per_seed[s] = seed_slope(sizes, [a[n][s] - b[n][s] for n in sizes])
    if not per_seed:
        raise ValueError("no seed has values of both families at every size")
    over = stats.paired_seed_comparison(
        per_seed, {s: 0.0 for s in per_seed}, confidence, names=("slope", "zero")
    )
    return GapSlope(tuple(sizes), per_seed, over, left_out)


def settled(low: float, high: float) -> bool | None:
    """The claims check's rule: settled where the interval excludes zero; None: no interval
    (fewer than 2 seeds, or every seed the same, a zero-width interval that is no certainty)."""
    if not (math.isfinite(low) and math.isfinite(high)) or low == high:
        return None
    return low > 0 or high < 0


def t_multiplier(n: int, confidence: float = 0.95) -> float:
    """How many standard errors of the mean the t-interval spans on each side with ``n`` seeds."""
    return float(scipy.stats.t.ppf(0.5 + confidence / 2, n - 1)) if n >= 2 else float("nan")


def size_text(n: int) -> str:
    return f"{n:,}"
