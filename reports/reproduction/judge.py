"""Re-trained cells judged against a study's published evidence, at three levels.

- bitwise: every logged metric, every point of every metric history and every prediction file
  equal to the published cell's (wall-clock figures left out). Expected only where the kernel
  identity matches (``workbench.kernel_identity``): the same code at the same thread count
  gives the same bits only on the same kernels.
- numerical: each re-trained cell's accuracy within the seed-to-seed spread (sample standard
  deviation over the published seeds of its arm) of the published value, on every split; the
  largest differences and the predicted-class agreement are reported beside it.
- conclusion: the study's comparisons (every pair the published report compares, on every split)
  recomputed with the re-trained cells in place of the published ones, by the report's own code
  (``reports.tables.compare``, ``reports.results.contents``): a verdict stands when the arm that is
  ahead over the whole deciding interval (or "not settled") is the same.

The level reached is the finest one whose check passes together with every coarser one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from reports import results, tables
from reports.collect import METRIC_KEYS, CellData, StudyData
from reports.evidence import Evidence
from reports.provenance import code_fingerprint
from workbench.code_history import same_code
from workbench.kernel_identity import kernel_differences, recorded_identity

LEVELS = ("conclusion", "numerical", "bitwise")  # coarse to fine
WALL_CLOCK = ("seconds", "per_second")  # never expected to repeat
# What the published cell's tags said about its machine, for cells that predate kernel.* params.
OLDER_MACHINE_TAGS = ("device.cpu_name", "device.cpu_capability", "threads", "torch_version")


def wall_clock(key: str) -> bool:
    return any(part in key for part in WALL_CLOCK)


def _number(value) -> float:
    return float(value)  # "NaN", "Infinity" of a JSON export read back as floats


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _diff(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return math.inf
    return 0.0 if _same(a, b) else abs(a - b)


@dataclass
class CellCheck:
    """One re-trained cell against its published run."""

    arm: str
    seed: int
    published_run: str
    retrained_run: str
    metrics: int = 0
    metrics_equal: int = 0
    metric_max_abs_diff: float = 0.0
    differing_metrics: list[str] = field(default_factory=list)
    history_points: int = 0
    history_equal: int = 0
    history_max_abs_diff: float = 0.0
    prediction_files: int = 0
    prediction_files_identical: int = 0
    predicted_rows: int = 0
    predicted_equal: int = 0
    accuracy: dict = field(default_factory=dict)  # split -> (published, re-trained, spread)
    kernel: list[str] = field(default_factory=list)  # differing kernel.* fields
    kernel_recorded: bool = True
    older_machine: dict = field(default_factory=dict)
    same_code: bool = True
    same_threads: bool = True

    @property
    def bitwise(self) -> bool:
        return (
            self.metrics_equal == self.metrics
            and self.history_equal == self.history_points
            and self.prediction_files_identical == self.prediction_files
            and self.predicted_equal == self.predicted_rows
        )

    @property
    def numerical(self) -> bool:
        return all(abs(b - a) <= spread for a, b, spread in self.accuracy.values())

    @property
    def bitwise_expected(self) -> bool:
        return self.kernel_recorded and not self.kernel and self.same_code and self.same_threads

    def lines(self) -> list[str]:
        """What a reader needs, one line per level."""
        diff = (
            f"; differing: {', '.join(self.differing_metrics[:8])}"
            + (" ..." if len(self.differing_metrics) > 8 else "")
            if self.differing_metrics
            else ""
        )
        if not self.kernel_recorded:
            said = ", ".join(f"{k} {v}" for k, v in self.older_machine.items())
            kernel = (
                f"not recorded by the published run (it predates kernel.* params; its tags: {said})"
            )
        elif self.kernel:
            kernel = "differs in " + "; ".join(self.kernel)
        else:
            kernel = "equal"
        expect = "bitwise equality expected" if self.bitwise_expected else "bitwise not guaranteed"
        if not self.same_code:
            expect += " (other code fingerprint)"
        if not self.same_threads:
            expect += " (other thread count)"
        acc = ", ".join(
            f"{split} {100 * a:.2f} -> {100 * b:.2f} ({100 * (b - a):+.2f} points; seed spread "
            f"{100 * s:.2f})"
            for split, (a, b, s) in self.accuracy.items()
        )
        agreement = self.predicted_equal / self.predicted_rows if self.predicted_rows else math.nan
        return [
            f"{self.arm}/seed{self.seed} (published {self.published_run}, re-trained "
            f"{self.retrained_run}): kernel identity {kernel}: {expect}",
            f"  bitwise: metrics {self.metrics_equal}/{self.metrics} equal (max |diff| "
            f"{self.metric_max_abs_diff:.3g}{diff}), history {self.history_equal}/"
            f"{self.history_points} (max |diff| {self.history_max_abs_diff:.3g}), prediction files "
            f"byte-identical {self.prediction_files_identical}/{self.prediction_files}: "
            f"{'equal' if self.bitwise else 'not equal'}",
            f"  numerical: accuracy {acc}; predicted class {self.predicted_equal}/"
            f"{self.predicted_rows} ({100 * agreement:.2f}%): "
            f"{'within' if self.numerical else 'outside'} the seed-to-seed spread",
        ]


def check_cell(
    published: CellData,
    entry: dict,
    retrained: CellData,
    histories: dict[str, list],
    spreads: dict[str, float],
) -> CellCheck:
    """Compare one cell: ``entry`` is its record in the published ``runs.json``, ``histories`` the
    re-trained run's metric histories (``tracking.export.run_export.metric_histories``),
    ``spreads`` split -> the published arm's seed-to-seed standard deviation of accuracy."""
    rec, new = published.record, retrained.record
    out = CellCheck(rec.arm, rec.seed, rec.run_id, new.run_id)
    for key, value in sorted(entry["metrics"].items()):
        if wall_clock(key):
            continue
        theirs, mine = _number(value), new.metrics.get(key)
        out.metrics += 1
        if mine is not None and _same(theirs, mine):
            out.metrics_equal += 1
        else:
            out.differing_metrics.append(key)
            out.metric_max_abs_diff = max(out.metric_max_abs_diff, _diff(theirs, mine))
    for key, points in sorted(entry.get("metric_history", {}).items()):
        if wall_clock(key):
            continue
        theirs = {int(step): _number(v) for step, _, v in points}  # a later value of a step wins
        mine = {int(step): _number(v) for step, _, v in histories.get(key, [])}
        for step, value in theirs.items():
            out.history_points += 1
            if step in mine and _same(value, mine[step]):
                out.history_equal += 1
            else:
                out.history_max_abs_diff = max(
                    out.history_max_abs_diff, _diff(value, mine.get(step))
                )
    for split, info in sorted((entry.get("predictions") or {}).items()):
        out.prediction_files += 1
        out.prediction_files_identical += retrained.sources.get(split) == info["logged_sha256"]
        theirs = published.predictions[split].set_index("index")["predicted"]
        mine = retrained.predictions.get(split)
        out.predicted_rows += len(theirs)
        if mine is not None:
            joined = mine.set_index("index")["predicted"].reindex(theirs.index)
            out.predicted_equal += int((joined.to_numpy() == theirs.to_numpy()).sum())
    for split, spread in spreads.items():
        key = METRIC_KEYS[split]
        if key in rec.metrics and key in new.metrics:
            out.accuracy[split] = (rec.metrics[key], new.metrics[key], spread)
    first, now = recorded_identity(rec.params), recorded_identity(new.params)
    out.kernel_recorded = bool(first)
    out.kernel = kernel_differences(first, now) if first else []
    out.older_machine = {k: rec.tags[k] for k in OLDER_MACHINE_TAGS if k in rec.tags}
    current = code_fingerprint(new) or ""
    out.same_code = same_code(code_fingerprint(rec), current)
    out.same_threads = rec.params.get("threads") == new.params.get("threads")
    return out


@dataclass(frozen=True)
class VerdictCheck:
    """One comparison's verdict, published and with the re-trained cells in place."""

    a: str
    b: str
    split: str
    published: str
    retrained: str
    published_difference: float  # mean a - b over seeds, points
    retrained_difference: float

    @property
    def stands(self) -> bool:
        return self.published == self.retrained

    def line(self) -> str:
        moved = "stands" if self.stands else f"MOVES to {self.retrained}"
        return (
            f"{self.split}: {self.a} - {self.b}: {self.published_difference:+.2f} -> "
            f"{self.retrained_difference:+.2f} points; verdict '{self.published}' {moved}"
        )


def verdicts(study: StudyData, pairs: list[tuple[str, str]], n_resamples: int) -> dict:
    """(a, b, split) -> (verdict, mean difference in points), as the report decides them."""
    out = {}
    for split in study.spec.splits:
        summaries = [tables.arm_summary(study, arm, split) for arm in study.spec.arms]
        rows = [tables.compare(study, a, b, split, n_resamples) for a, b in pairs]
        for c, content in results.contents(rows, summaries, len(study.spec.seeds), 2):
            if content is None:
                out[(c.a, c.b, split)] = ("no comparison", math.nan)
                continue
            par = content.paragraph
            if par.sign_settled:
                verdict = f"{par.settled_for} ahead"
            elif par.sign_settled is False:
                verdict = "not settled"
            else:
                verdict = "no interval"
            out[(c.a, c.b, split)] = (verdict, 100 * c.paired.mean_difference)
    return out


def check_conclusions(
    evidence: Evidence, retrained: dict[tuple[str, int], CellData]
) -> list[VerdictCheck]:
    """Every comparison of the published report, with the re-trained cells in place."""
    study = evidence.study
    pairs = tables.comparison_pairs(study, evidence.inputs.compare)
    swapped = replace(study, cells={**study.cells, **retrained})
    before = verdicts(study, pairs, evidence.inputs.n_resamples)
    after = verdicts(swapped, pairs, evidence.inputs.n_resamples)
    return [
        VerdictCheck(
            a,
            b,
            split,
            before[(a, b, split)][0],
            after[(a, b, split)][0],
            before[(a, b, split)][1],
            after[(a, b, split)][1],
        )
        for a, b, split in before
    ]


def spreads(study: StudyData, arm: str) -> dict[str, float]:
    """Split -> the published arm's sample standard deviation of accuracy over seeds (0 for one seed)."""
    out = {}
    for split in study.spec.splits:
        std = tables.arm_summary(study, arm, split).std
        out[split] = 0.0 if not np.isfinite(std) else float(std)
    return out


def level_reached(cells: list[CellCheck], conclusions: list[VerdictCheck]) -> str:
    """The finest level whose check passes with every coarser one ("none" when even the conclusion moves)."""
    passed = {
        "conclusion": all(v.stands for v in conclusions),
        "numerical": all(c.numerical for c in cells),
        "bitwise": all(c.bitwise for c in cells),
    }
    reached = "none"
    for level in LEVELS:
        if not passed[level]:
            break
        reached = level
    return reached


def at_least(reached: str, asked: str) -> bool:
    order = ("none", *LEVELS)
    return order.index(reached) >= order.index(asked)
