"""Displayed numbers a reader can recompute: rounding with exact decimal arithmetic.

A table that shows 68.38 and 39.50 must show their difference as +28.88, not the rounded
true difference +28.87. Values are rounded first (half away from zero, in ``Decimal`` so
binary noise such as 68.37499999999999 for 68.375 does not flip a digit), and every
displayed difference is the exact difference of the displayed values. When the decimals
are not given, the fewest (from 2 up to 3) that show every value exactly are used:
accuracies on 800 images are multiples of 0.125 points and need 3.

Bootstrap endpoints get only the decimals their Monte-Carlo error supports
(``numbers.decimals_for_error``), and that error is returned for the footnote.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from workbench.estimates import decimals_for_error

_NOISE_DIGITS = 9  # float noise below 1e-9 (after scaling) is removed before rounding


def to_decimal(x: float, decimals: int) -> Decimal:
    """``x`` rounded half away from zero to ``decimals`` places, exactly, as a Decimal."""
    if not math.isfinite(x):
        raise ValueError(f"cannot display non-finite value {x!r}")
    clean = Decimal(repr(round(float(x), _NOISE_DIGITS)))
    return clean.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)


def fmt(x: float | Decimal, decimals: int, signed: bool = False) -> str:
    """``x`` with ``decimals`` places (half away from zero); ``signed`` adds + to positives.

    Zero is shown without a sign ("0.00", never "+0.00" or "-0.00"); nan shows as "n/a".
    """
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    d = (
        x.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)
        if isinstance(x, Decimal)
        else to_decimal(x, decimals)
    )
    if d == 0:
        return f"{abs(d):.{decimals}f}"
    return f"{d:+.{decimals}f}" if signed else f"{d:.{decimals}f}"


def exact_decimals(values: Sequence[float], min_decimals: int = 2, max_decimals: int = 3) -> int:
    """Fewest decimals in [min, max] that show every value exactly (``max`` if none does)."""
    for d in range(min_decimals, max_decimals + 1):
        if all(abs(float(to_decimal(v, d)) - v) < 10.0**-_NOISE_DIGITS for v in values):
            return d
    return max_decimals


@dataclass(frozen=True)
class PairedDisplay:
    """Per-seed values of two arms and their differences, as strings that agree.

    ``differences[i]`` equals ``a[i] - b[i]`` exactly as displayed. ``exact`` says whether
    the displayed values are the underlying values (then the displayed differences are the
    true differences too); when not, the footnote should say values were rounded first.
    """

    a: list[str]
    b: list[str]
    differences: list[str]
    decimals: int
    exact: bool


def paired_display(
    a: Sequence[float],
    b: Sequence[float],
    scale: float = 100.0,
    decimals: int | None = None,
    max_decimals: int = 3,
) -> PairedDisplay:
    """Displayed per-seed values and differences (a - b) a reader can recompute.

    Args:
        a: Arm a's per-seed values, in seed order (e.g. accuracies in [0, 1]).
        b: Arm b's values for the same seeds.
        scale: Multiplier before display (100: points).
        decimals: Fixed decimals; None picks the fewest in [2, ``max_decimals``] that show
            every value exactly.
        max_decimals: Upper bound when ``decimals`` is None.
    """
    if len(a) != len(b):
        raise ValueError(f"paired_display: {len(a)} values of a but {len(b)} of b")
    sa, sb = [float(x) * scale for x in a], [float(x) * scale for x in b]
    d = exact_decimals(sa + sb, 2, max_decimals) if decimals is None else int(decimals)
    ra, rb = [to_decimal(x, d) for x in sa], [to_decimal(x, d) for x in sb]
    exact = all(abs(float(r) - x) < 10.0**-_NOISE_DIGITS for r, x in zip(ra + rb, sa + sb))
    return PairedDisplay(
        [fmt(x, d) for x in ra],
        [fmt(x, d) for x in rb],
        [fmt(x - y, d, signed=True) for x, y in zip(ra, rb)],
        d,
        exact,
    )


@dataclass(frozen=True)
class BootstrapDisplay:
    """Bootstrap endpoints at the decimals their Monte-Carlo error supports."""

    low: str
    high: str
    estimate: str  # the full-data value has no Monte-Carlo error: ``estimate_decimals``
    decimals: int
    mc_error: float  # the larger endpoint SE, scaled (e.g. points)
    n_resamples: int
    footnote: str


def bootstrap_display(
    ci: Any,
    scale: float = 100.0,
    unit: str = "points",
    max_decimals: int = 3,
    signed: bool = True,
    estimate_decimals: int = 2,
) -> BootstrapDisplay:
    """Format a ``workbench.stats.CI`` so no displayed digit is Monte-Carlo noise.

    Args:
        ci: A CI with ``low``, ``high``, ``estimate``, ``n_resamples``, ``mc_error_low``,
            ``mc_error_high`` (every CI from ``workbench.stats`` has them).
        scale: Multiplier before display.
        unit: Unit of the scaled numbers, for the footnote.
        max_decimals: Cap (also used when the error is zero or unknown).
        signed: Show + on positive endpoints (differences).
        estimate_decimals: Decimals of the point estimate (computed on all data, no resampling).
    """
    errors = [
        e
        for e in (getattr(ci, "mc_error_low", math.nan), getattr(ci, "mc_error_high", math.nan))
        if math.isfinite(e)
    ]
    se = max(errors) * scale if errors else math.nan
    d = decimals_for_error(se, max_decimals)
    if math.isfinite(se):
        footnote = (
            f"bootstrap endpoints shown to {d} decimal{'s' if d != 1 else ''}: their Monte-Carlo standard "
            f"error is {se:.2g} {unit} at {ci.n_resamples:,} resamples (order-statistic estimate)"
        )
    else:
        footnote = (
            f"Monte-Carlo error of the bootstrap endpoints unknown ({ci.n_resamples:,} resamples)"
        )
    return BootstrapDisplay(
        fmt(ci.low * scale, d, signed),
        fmt(ci.high * scale, d, signed),
        fmt(ci.estimate * scale, estimate_decimals, signed),
        d,
        se,
        int(ci.n_resamples),
        footnote,
    )
