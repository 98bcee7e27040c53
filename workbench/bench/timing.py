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
"""

from __future__ import annotations

import math
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
