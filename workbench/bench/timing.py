"""Interleaved timing of competing callables, and robust summaries of the samples.

Candidates are timed in rounds, one sample of each per round (A B C, B C A, ...), after a
warm-up, so that a slow phase of a shared machine (another job starting, a frequency
change) hits every candidate alike instead of whichever happened to run then. The order
rotates each round so that no candidate always runs right after the same neighbour (cache
and allocator state carry over). Ratios are taken per round and then summarised, which
cancels the load drift that a ratio of two overall medians would keep.

On CUDA a sample is bracketed by CUDA events and synchronised; on CPU it is
``time.perf_counter``. A sample runs the callable ``inner`` times, chosen during warm-up so
that one sample lasts at least ``min_sample_s``: sub-millisecond calls are otherwise
dominated by timer and scheduler noise.

Verdicts (``decide``): an option is ``faster`` (``slower``) than the reference when the 95 %
sign-test interval of the median of its per-round time ratios lies wholly below (above) 1,
and ``not resolved at this noise`` otherwise; the interval needs at least 6 rounds. ``use:``
names the option resolved faster than every other choosable one, or the options none of
which is resolved slower than another ("either" when that is all of them).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Spread:
    """Median, quartiles and extremes of a list of values."""

    median: float
    q1: float
    q3: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            raise ValueError("Spread.of: no values")
        v = sorted(values)
        if len(v) == 1:
            return cls(v[0], v[0], v[0], v[0], v[0])
        q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
        return cls(statistics.median(v), q1, q3, v[0], v[-1])

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


@dataclass
class Samples:
    """Seconds per call of each candidate, one value per round, rounds aligned."""

    seconds: dict[str, list[float]]
    inner: dict[str, int]  # calls per sample

    def spread(self, name: str) -> Spread:
        return Spread.of(self.seconds[name])

    def ratios(self, name: str, reference: str) -> list[float]:
        """Per-round ratio of seconds per call, ``name`` over ``reference`` (>1: slower)."""
        return [a / b for a, b in zip(self.seconds[name], self.seconds[reference], strict=True)]


def _sample(fn: Callable[[], object], inner: int, device: torch.device) -> float:
    """Seconds per call over ``inner`` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # nothing queued before the start event
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def time_interleaved(
    candidates: dict[str, Callable[[], object]],
    device: torch.device | str,
    repeats: int = 5,
    warmup: int = 2,
    min_sample_s: float = 0.05,
    max_inner: int = 1000,
    max_seconds: float | None = None,
    min_repeats: int = 3,
    separate: tuple[str, ...] = (),
) -> Samples:
    """Time each candidate ``repeats`` times in interleaved rounds after ``warmup`` calls.

    Args:
        candidates: Name -> zero-argument callable doing one unit of work (one forward
            pass, one training step). All get the same number of calls per sample.
        device: Where the work runs; CUDA work is timed with events.
        repeats: Timed rounds (one sample of each candidate per round).
        warmup: Untimed calls of each candidate first (allocations, kernel selection,
            caches), cut short once a candidate has spent a second warming up; the
            slowest candidate's last warm-up call sets the calls per sample.
        min_sample_s: Shortest wanted sample; fast calls are repeated to reach it.
        max_inner: Cap on calls per sample.
        max_seconds: Time budget of the timed rounds: once spent, no new round starts,
            but at least ``min_repeats`` rounds run. None: all ``repeats`` rounds.
        min_repeats: Rounds that run whatever the budget (capped at ``repeats``).
        separate: Candidates sized on their own rather than sharing the others' calls per
            sample: a reference probe (the matmul) timed in the same rounds.

    Returns:
        Per-candidate seconds per call, one value per round (``repeats`` rounds, or fewer
        when ``max_seconds`` ran out).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    device = torch.device(device)
    names = list(candidates)
    warm: dict[str, float] = {}
    for name in names:
        spent = 0.0
        for _ in range(max(warmup, 1)):  # at least one call, to size the samples
            warm[name] = _sample(candidates[name], 1, device)  # the last is the warmed-up call
            spent += warm[name]
            if spent > 1.0:  # one call of a second or more has paid the one-off costs
                break

    def calls(seconds_per_call: float) -> int:
        return max(1, min(max_inner, math.ceil(min_sample_s / max(seconds_per_call, 1e-9))))

    # Compared candidates share one count, sized on the slowest so that every sample
    # reaches min_sample_s and every candidate makes the same number of calls.
    shared = calls(max([warm[n] for n in names if n not in separate], default=0.0))
    inner = {name: calls(warm[name]) if name in separate else shared for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    for r in range(repeats):
        if (
            max_seconds is not None
            and r >= min(min_repeats, repeats)
            and time.perf_counter() - started > max_seconds
        ):
            break  # every candidate has the same number of rounds: stop between rounds only
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(_sample(candidates[name], inner[name], device))
    return Samples(seconds=seconds, inner=inner)


# --- Verdicts: what the rounds resolve, and what to choose on this machine -------------------

LEVEL = 0.95  # coverage of the interval a verdict is read from


def load_average() -> float:
    """The machine's 1-minute load average (NaN where the OS does not report one)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


@dataclass(frozen=True)
class Load:
    """The machine's load around a benchmark: a load above the cores means shared cores."""

    start: float
    end: float = math.nan
    cores: int = os.cpu_count() or 1

    @classmethod
    def begin(cls) -> "Load":
        return cls(load_average())

    def finish(self) -> "Load":
        return Load(self.start, load_average(), self.cores)

    @property
    def line(self) -> str:
        return (
            f"load average {self.start:.2f} at the start, {self.end:.2f} at the end, on "
            f"{self.cores} cores"
        )

    def as_dict(self) -> dict[str, float]:
        return {"load_start": self.start, "load_end": self.end, "cores": float(self.cores)}


def sign_interval(values: list[float], level: float = LEVEL) -> tuple[float, float]:
    """Distribution-free interval of the median of ``values`` (the sign test's), NaN when too few.

    The interval runs from the k-th smallest to the k-th largest value, with k the largest
    order for which the coverage ``1 - 2 P(Binomial(n, 1/2) <= k - 1)`` is at least ``level``.
    It assumes only that the rounds are independent: at 95 % it needs 6 rounds (then it is
    the smallest to the largest value).
    """
    v, n = sorted(values), len(values)
    k = 0
    while k < (n + 1) // 2 and 2 * _binomial_cdf(k + 1, n) <= 1 - level:
        k += 1
    if k == 0:
        return math.nan, math.nan
    return v[k - 1], v[n - k]


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k - 1)."""
    return sum(math.comb(n, i) for i in range(k)) / 2**n


def rounds_needed(level: float = LEVEL) -> int:
    """The fewest rounds whose sign interval exists at ``level``."""
    n = 1
    while math.isnan(sign_interval([1.0] * n, level)[0]):
        n += 1
    return n


@dataclass(frozen=True)
class Verdict:
    """One comparison: ``name`` against ``reference``, from per-round time ratios.

    Attributes:
        name: The option compared.
        reference: What it is compared with.
        ratio: Median of the per-round ratios of time per unit of work, name / reference
            (below 1: ``name`` is faster).
        low: Lower end of the ratio's sign interval (NaN with too few rounds).
        high: Upper end.
        rounds: Rounds (paired measurements) the ratios come from.
    """

    name: str
    reference: str
    ratio: float
    low: float
    high: float
    rounds: int

    @property
    def word(self) -> str:
        """``faster`` or ``slower`` when the interval excludes 1, else ``not resolved``."""
        if self.high < 1.0:
            return "faster"
        if self.low > 1.0:
            return "slower"
        return "not resolved"

    @property
    def line(self) -> str:
        if math.isnan(self.low):
            why = f"{self.rounds} rounds: {rounds_needed()} needed for a {LEVEL:.0%} interval"
            span = f"time ratio {self.ratio:.3f} ({why})"
        else:
            span = f"time ratio {self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}], {self.rounds} rounds"
        word = self.word if self.word != "not resolved" else "not resolved at this noise"
        return f"{self.name} vs {self.reference}: {word}; {span}"


def compare(seconds: dict[str, list[float]], name: str, reference: str) -> Verdict:
    """The verdict of ``name`` against ``reference`` from their per-round seconds (rounds aligned)."""
    ratios = [a / b for a, b in zip(seconds[name], seconds[reference], strict=True)]
    low, high = sign_interval(ratios)
    return Verdict(name, reference, statistics.median(ratios), low, high, len(ratios))


def use_line(seconds: dict[str, list[float]], choices: list[str]) -> str:
    """``use: X`` for the option resolved faster than every other one, else the unresolved set.

    An option is dropped when some other option is resolved faster than it; the remaining
    ones are named, or ``either`` / ``any`` when none was dropped.
    """
    if len(choices) < 2:
        return f"use: {choices[0]} (the only option timed)" if choices else "use: -"
    for a in choices:
        if all(compare(seconds, a, b).word == "faster" for b in choices if b != a):
            return f"use: {a} (resolved faster than {', '.join(b for b in choices if b != a)})"
    kept = [
        a
        for a in choices
        if not any(compare(seconds, a, b).word == "slower" for b in choices if b != a)
    ]
    if len(kept) == len(choices):
        return f"use: {'either' if len(kept) == 2 else 'any'} (not resolved)"
    return f"use: {' or '.join(kept)} (not resolved between them)"


def goal_verdict(unit_seconds: list[float], units: int, goal_seconds: float) -> str:
    """Whether ``units`` units of work fit in ``goal_seconds``, from the per-unit seconds measured.

    ``met`` (``missed``) when the sign interval of the median per-unit time, times ``units``,
    lies wholly under (over) the goal; ``not resolved at this noise`` otherwise.
    """
    low, high = sign_interval(unit_seconds)
    if math.isnan(low):
        return (
            f"not resolved at this noise ({len(unit_seconds)} units timed: "
            f"{rounds_needed()} needed for a {LEVEL:.0%} interval)"
        )
    span = f"{units} x [{low:.3g}, {high:.3g}] s = [{units * low:.4g}, {units * high:.4g}] s"
    if units * high < goal_seconds:
        return f"met ({span} under {goal_seconds:.4g} s)"
    if units * low > goal_seconds:
        return f"missed ({span} over {goal_seconds:.4g} s)"
    return f"not resolved at this noise ({span} holds {goal_seconds:.4g} s)"


@dataclass(frozen=True)
class Decision:
    """The verdicts of one comparison group and what to use, with the spread of its rounds.

    Attributes:
        scope: What was compared (an arm, a model and batch), for the printed lines and keys.
        verdicts: Every option against the reference.
        use: The ``use: ...`` line (among the choosable options only).
        spreads: Seconds per round of every option: the spread of the rounds.
    """

    scope: str
    verdicts: tuple[Verdict, ...]
    use: str
    spreads: dict[str, Spread]

    @property
    def lines(self) -> list[str]:
        head = f"{self.scope}: " if self.scope else ""
        spread = ", ".join(f"{n} {s.min:.4g}-{s.max:.4g} s" for n, s in self.spreads.items())
        return (
            [f"{head}rounds' spread (min-max s per round): {spread}"]
            + [f"{head}{v.line}" for v in self.verdicts]
            + [f"{head}{self.use}"]
        )

    def metrics(self) -> dict[str, float]:
        """``verdict/<scope>/<name>_vs_<reference>/{ratio,low,high,resolved}`` (NaNs left out)."""
        out: dict[str, float] = {}
        for v in self.verdicts:
            key = f"verdict/{self.scope}/{v.name}_vs_{v.reference}".replace("//", "/")
            for what, value in (("ratio", v.ratio), ("low", v.low), ("high", v.high)):
                if math.isfinite(value):
                    out[f"{key}/{what}"] = value
            out[f"{key}/resolved"] = float(v.word != "not resolved")
        return out

    def columns(self, name: str) -> dict[str, object]:
        """Table columns of option ``name``: its verdict against the reference, and the use line."""
        v = next((v for v in self.verdicts if v.name == name), None)
        return {
            "verdict_reference": self.verdicts[0].reference if self.verdicts else name,
            "verdict": v.word if v else "reference",
            "verdict_ratio": v.ratio if v else 1.0,
            "verdict_low": v.low if v else math.nan,
            "verdict_high": v.high if v else math.nan,
            "use": self.use,
        }

    @classmethod
    def from_rows(cls, scope: str, rows: list[dict]) -> "Decision":
        """The decision back from table rows written with ``columns`` (``variant``, ``repeats``,
        ``median_s``, ``q1_s``, ``q3_s``, ``min_s``, ``max_s`` besides)."""
        # fmt: skip
        verdicts = tuple(
            Verdict(
                r["variant"],
                r["verdict_reference"],
                r["verdict_ratio"],
                r["verdict_low"],
                r["verdict_high"],
                int(r["repeats"]),
            )
            for r in rows
            if r["verdict"] != "reference"
        )
        spreads = {
            r["variant"]: Spread(r["median_s"], r["q1_s"], r["q3_s"], r["min_s"], r["max_s"])
            for r in rows
        }
        return cls(scope, verdicts, rows[0]["use"], spreads)

    def tags(self) -> dict[str, str]:
        """``use.<scope>`` and ``verdict.<scope>.<name>_vs_<reference>``: the words, searchable."""
        scope = self.scope.replace("/", ".") or "all"
        tags = {f"use.{scope}": self.use.removeprefix("use: ")}
        for v in self.verdicts:
            tags[f"verdict.{scope}.{v.name}_vs_{v.reference}"] = v.word
        return tags


def decide(
    seconds: dict[str, list[float]],
    reference: str,
    choices: list[str] | None = None,
    scope: str = "",
) -> Decision:
    """Verdicts of every option against ``reference`` and the ``use:`` line among ``choices``.

    Args:
        seconds: Option -> time per unit of work, one value per round, rounds aligned (the
            same round index was measured at the same time, or on the same work).
        reference: The option every other is compared with.
        choices: The options a user can pick (default: all); the others (a measurement
            only, or a different amount of work) get a verdict but are never proposed.
        scope: Name of the comparison group.
    """
    options = list(seconds)
    if reference not in seconds:
        raise ValueError(f"decide: reference {reference!r} is not one of {options}")
    verdicts = tuple(compare(seconds, n, reference) for n in options if n != reference)
    chosen = [n for n in (choices if choices is not None else options) if n in seconds]
    spreads = {n: Spread.of(seconds[n]) for n in options}
    return Decision(scope, verdicts, use_line(seconds, chosen), spreads)
