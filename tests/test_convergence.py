"""The convergence reading of a validation curve: best epoch against last, late slope."""

from __future__ import annotations

import numpy as np
import pytest

from reports.common.convergence import convergence, convergence_blocks, least_squares_slope
from reports.render import Para, Table, to_markdown


def test_a_rising_curve_is_still_improving_with_its_least_squares_late_slope():
    # 8 epochs: the last quarter is 2 epochs; 0.50 -> 0.53 is +3 points per epoch
    curve = {e: 0.30 + 0.03 * e for e in range(1, 9)}
    c = convergence(curve)
    assert (c.epochs, c.best_epoch, c.late_epochs) == (8, 8, 2)
    assert c.late_slope == pytest.approx(3.0, abs=1e-9), c.late_slope
    assert c.best == pytest.approx(54.0, abs=1e-9) and c.last == pytest.approx(54.0, abs=1e-9)
    assert c.still_improving


def test_a_curve_that_peaked_early_has_flattened_and_its_slope_matches_polyfit():
    values = [0.40, 0.50, 0.55, 0.58, 0.60, 0.61, 0.605, 0.61, 0.608, 0.604, 0.609, 0.607]
    curve = dict(enumerate(values, start=1))
    c = convergence(curve)
    # 12 epochs: the last quarter is 3 epochs (10, 11, 12); the first maximum, 0.61, is epoch 6
    assert (c.best_epoch, c.late_epochs) == (6, 3)
    expected = np.polyfit([10.0, 11.0, 12.0], [60.4, 60.9, 60.7], 1)[0]
    assert abs(c.late_slope - expected) < 1e-9, abs(c.late_slope - expected)
    assert not c.still_improving


def test_best_at_the_last_epoch_with_a_falling_late_slope_is_not_still_improving():
    c = convergence({1: 0.5, 2: 0.6, 3: 0.58, 4: 0.55, 5: 0.5, 6: 0.6})
    assert c.best_epoch == 2 and not c.still_improving  # 0.6 first reached at epoch 2
    one = convergence({1: 0.5})
    assert one is None


def test_the_blocks_count_cells_and_name_the_slope_range():
    curves = {("a", 0): {1: 0.1, 2: 0.2}, ("a", 1): {1: 0.3, 2: 0.25}, ("b", 0): {1: 0.5}}
    blocks = convergence_blocks(curves, ["a", "b"])
    assert isinstance(blocks[0], Para) and isinstance(blocks[1], Table)
    text = to_markdown(blocks)
    assert "1 of 2 cells had their best validation accuracy at their last epoch" in text, text
    assert "from -5.00 to +10.00 points per epoch" in text, text
    assert len(blocks[1].rows) == 2  # the one-epoch cell has no reading
    assert convergence_blocks({("a", 0): {1: 0.1}}, ["a"]) == []


def test_a_slope_on_a_rounding_edge_is_exact_and_the_same_on_every_machine():
    # fmnist_seed_recipe_retrained, cnn seed 4, epochs 16-20 on 800 validation images: the
    # accuracies are exact binary fractions and the true slope is exactly 33/40 = 0.825 points per
    # epoch, on the second decimal's edge. polyfit's LAPACK path gave 0.825 +- 1 ulp depending on
    # the CPU (+0.83 published on one machine, +0.82 rebuilt in CI on another).
    epochs = [16, 17, 18, 19, 20]
    values = [100.0 * v for v in (0.76625, 0.7775, 0.78625, 0.805, 0.79375)]
    slope = least_squares_slope(epochs, values)
    assert slope == 0.825, f"{slope!r} differs from 0.825 by {abs(slope - 0.825)!r}"
    assert f"{slope:+.2f}" == "+0.82"  # the float nearest 0.825 lies just below it
    # reordering the points changes nothing: the sums are exact
    assert least_squares_slope(epochs[::-1], values[::-1]) == slope
    # a flat curve's slope is exactly zero, never -0.00
    assert f"{least_squares_slope([5, 6], [34.65, 34.65]):+.2f}" == "+0.00"
    with pytest.raises(ValueError, match="2 distinct x values"):
        least_squares_slope([3, 3], [1.0, 2.0])
