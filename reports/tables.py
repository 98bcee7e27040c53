"""The report's numbers, computed from a ``StudyData`` with ``workbench.stats``.

Values per seed are the MLflow metrics of the chosen runs (``best_val_accuracy``,
``test_accuracy``); the bootstrap and the per-class numbers come from the saved prediction
files of the same runs, and ``consistency_problems`` checks that the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reports.collect import METRIC_KEYS, StudyData, has_split, labels_and_predictions
from workbench import stats

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # fixed: rebuilding a report gives the same intervals
CONFIDENCE = 0.95


@dataclass(frozen=True)
class ArmSummary:
    """Accuracy of one arm on one split over its finished seeds."""

    arm: str
    split: str
    values: dict[int, float]  # seed -> accuracy, finished seeds only
    expected_seeds: tuple[int, ...]
    mean: float
    std: float  # sample std (ddof=1); nan for one seed

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def missing_seeds(self) -> list[int]:
        return [s for s in self.expected_seeds if s not in self.values]


@dataclass(frozen=True)
class Comparison:
    """Arm a against arm b on one split, paired by seed."""

    a: str
    b: str
    split: str
    expected_n: int
    paired: stats.PairedComparison | None  # None when no seed has both arms
    bootstrap: stats.CI | None
    note: str = ""  # why something is missing or partial


@dataclass(frozen=True)
class PerClass:
    """Per-class accuracy (recall) over seeds and the confusion matrix summed over seeds."""

    arm: str
    split: str
    recall: np.ndarray  # (S, K): one row per finished seed
    confusion: np.ndarray  # (K, K) counts, rows true class, columns predicted, summed over seeds
    seeds: list[int] = field(default_factory=list)


def arm_summary(study: StudyData, arm: str, split: str) -> ArmSummary:
    key = METRIC_KEYS[split]
    values = {
        s: float(study.cells[(arm, s)].record.metrics[key])
        for s in study.spec.seeds
        if (arm, s) in study.cells and has_split(study.cells[(arm, s)], split)
    }
    if not values:
        return ArmSummary(arm, split, {}, study.spec.seeds, float("nan"), float("nan"))
    summary = stats.summarize_over_seeds(values)
    return ArmSummary(arm, split, values, study.spec.seeds, summary["mean"], summary["std"])


def comparison_pairs(study: StudyData, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every arm against the reference (protocol order), then the requested pairs, without repeats."""
    ref = study.spec.reference
    pairs = [(a, ref) for a in study.spec.arms if a != ref]
    for a, b in extra:
        for arm in (a, b):
            if arm not in study.spec.arms:
                raise ValueError(
                    f"--compare {a}:{b}: arm {arm!r} is not in protocol {study.spec.name!r} "
                    f"(arms: {', '.join(study.spec.arms)})"
                )
        if a == b:
            raise ValueError(f"--compare {a}:{b}: an arm compared with itself")
        if (a, b) not in pairs:
            pairs.append((a, b))
    return pairs


def compare(
    study: StudyData, a: str, b: str, split: str, n_resamples: int = BOOTSTRAP_RESAMPLES
) -> Comparison:
    """Seed-paired comparison of a - b: t-interval over seeds and hierarchical bootstrap CI."""
    sa, sb = arm_summary(study, a, split), arm_summary(study, b, split)
    expected = len(study.spec.seeds)
    shared = [s for s in study.spec.seeds if s in sa.values and s in sb.values]
    if not shared:
        return Comparison(
            a, b, split, expected, None, None, "no seed has finished runs of both arms"
        )
    # allow_missing: a missing cell is shown (n of expected, flagged), never silently dropped.
    paired = stats.paired_seed_comparison(
        sa.values, sb.values, CONFIDENCE, allow_missing=True, names=(a, b)
    )
    per_a = {s: labels_and_predictions(study.cells[(a, s)], split) for s in shared}
    per_b = {s: labels_and_predictions(study.cells[(b, s)], split) for s in shared}
    note, boot = "", None
    try:
        boot = stats.paired_hierarchical_bootstrap(
            per_a,
            per_b,
            "accuracy",
            n_resamples,
            CONFIDENCE,
            BOOTSTRAP_SEED,
            num_classes=study.num_classes or None,
        )
    except (
        ValueError
    ) as err:  # e.g. the arms were evaluated on different examples: say so, keep the t-interval
        note = f"no bootstrap: {err}"
    return Comparison(a, b, split, expected, paired, boot, note)


def per_class(study: StudyData, arm: str, split: str) -> PerClass | None:
    seeds = [
        s
        for s in study.spec.seeds
        if (arm, s) in study.cells and has_split(study.cells[(arm, s)], split)
    ]
    if not seeds:
        return None
    k = study.num_classes
    recalls, confusion = [], np.zeros((k, k), dtype=np.int64)
    for s in seeds:
        m = stats.classification_metrics(
            *labels_and_predictions(study.cells[(arm, s)], split), num_classes=k
        )
        recalls.append(m["per_class_recall"])
        confusion += m["confusion_matrix"]
    return PerClass(arm, split, np.array(recalls, dtype=np.float64), confusion, seeds)


def consistency_problems(study: StudyData, tolerance: float = 1e-9) -> list[str]:
    """Runs lacking a split's result, or whose logged accuracy differs from their own prediction file."""
    problems = []
    order = {arm: i for i, arm in enumerate(study.spec.arms)}
    for (arm, seed), cell in sorted(
        study.cells.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])
    ):
        for split in study.spec.splits:
            if not has_split(cell, split):
                problems.append(
                    f"{arm}/seed{seed} (run {cell.record.run_id}) has no {split} result (metric "
                    f"{METRIC_KEYS[split]} and predictions/{split}.csv): counted as missing there"
                )
                continue
            logged = cell.record.metrics[METRIC_KEYS[split]]
            y, p = labels_and_predictions(cell, split)
            recomputed = float((y == p).mean())
            if abs(logged - recomputed) > tolerance:
                problems.append(
                    f"{arm}/seed{seed} (run {cell.record.run_id}): {METRIC_KEYS[split]} = {logged} "
                    f"but predictions/{split}.csv gives {recomputed}"
                )
    return problems


def best_epochs(study: StudyData, arm: str) -> dict[int, int | None]:
    """Seed -> best epoch (metric ``best_epoch``) of the chosen runs of ``arm``."""
    out = {}
    for s in study.spec.seeds:
        cell = study.cells.get((arm, s))
        if cell is not None:
            best = cell.record.metrics.get("best_epoch")
            out[s] = None if best is None else int(best)
    return out


# ------------------------------------------------------------- differences of differences


@dataclass(frozen=True)
class Interaction:
    """(a - b) - (c - d) on one split, paired by seed: e.g. a recipe's gain on one model minus its gain on another.

    ``paired`` compares the per-seed differences a - b (as its arm a) with c - d (as its arm b),
    so its differences are the per-seed interactions and its t-interval, p-values and wins are
    theirs; ``values`` holds each arm's per-seed values, for the per-seed display.
    """

    arms: tuple[str, str, str, str]
    split: str
    expected_n: int
    paired: stats.PairedComparison | None  # None when no seed has all four arms
    bootstrap: stats.CI | None
    # arm -> seed -> value, the shared seeds
    values: dict[str, dict[int, float]] = field(default_factory=dict)
    note: str = ""


def check_interactions(
    study: StudyData, quads: list[tuple[str, str, str, str]]
) -> list[tuple[str, str, str, str]]:
    """The requested interactions, each of four distinct arms of the protocol, without repeats.

    Raises:
        ValueError: An arm not in the protocol or named twice in one interaction (the message names the value).
    """
    out = []
    for quad in quads:
        value = ":".join(quad)
        for arm in quad:
            if arm not in study.spec.arms:
                raise ValueError(
                    f"--interaction {value}: arm {arm!r} is not in protocol {study.spec.name!r} "
                    f"(arms: {', '.join(study.spec.arms)})"
                )
        twice = sorted({arm for arm in quad if quad.count(arm) > 1})
        if twice:
            raise ValueError(
                f"--interaction {value}: arm {twice[0]!r} named twice; (A - B) - (C - D) needs four "
                "different arms"
            )
        if tuple(quad) not in out:
            out.append(tuple(quad))
    return out


def interaction(
    study: StudyData,
    arms: tuple[str, str, str, str],
    split: str,
    n_resamples: int = BOOTSTRAP_RESAMPLES,
) -> Interaction:
    """(a - b) - (c - d) over the seeds where all four arms finished: t-interval over seeds and hierarchical bootstrap."""
    summaries = [arm_summary(study, arm, split) for arm in arms]
    expected = len(study.spec.seeds)
    shared = [s for s in study.spec.seeds if all(s in x.values for x in summaries)]
    if not shared:
        return Interaction(
            arms, split, expected, None, None, {}, "no seed has finished runs of all four arms"
        )
    values = {x.arm: {s: x.values[s] for s in shared} for x in summaries}
    a, b, c, d = (values[arm] for arm in arms)
    paired = stats.paired_seed_comparison(
        {s: a[s] - b[s] for s in shared},
        {s: c[s] - d[s] for s in shared},
        CONFIDENCE,
        names=(f"{arms[0]} - {arms[1]}", f"{arms[2]} - {arms[3]}"),
    )
    missing = [
        f"{x.arm}: seed {', '.join(map(str, x.missing_seeds))}"
        for x in summaries
        if x.missing_seeds
    ]
    notes = (
        [
            f"compared on the {len(shared)} seeds where all four arms finished (missing {'; '.join(missing)})"
        ]
        if missing
        else []
    )
    per_seed = [
        {s: labels_and_predictions(study.cells[(arm, s)], split) for s in shared} for arm in arms
    ]
    boot = None
    try:
        boot = stats.hierarchical_interaction_bootstrap(
            per_seed,
            "accuracy",
            n_resamples,
            CONFIDENCE,
            BOOTSTRAP_SEED,
            num_classes=study.num_classes or None,
        )
    except (
        ValueError
    ) as err:  # e.g. the arms were evaluated on different examples: say so, keep the t-interval
        notes.append(f"no bootstrap: {err}")
    return Interaction(arms, split, expected, paired, boot, values, "; ".join(notes))
