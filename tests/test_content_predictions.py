"""reports.content.predictions: never-predicted classes are named, zero-width intervals need a warning."""

from __future__ import annotations

import numpy as np
import pytest

from workbench import stats
from reports.content.predictions import (
    ZeroWidthIntervalError,
    degenerate_predictions,
    interval_text,
)


def retina_like(rng, never: set[int], n: int = 400):
    """Five grades with 20 grade-4 images; predictions that avoid the classes in ``never``."""
    y = np.concatenate([rng.integers(0, 4, n - 20), np.full(20, 4)])
    p = np.clip(y + rng.integers(-1, 2, n), 0, 4)
    allowed = np.array([c for c in range(5) if c not in never])
    bad = np.isin(p, list(never))
    # nearest allowed grade
    p[bad] = allowed[np.abs(allowed[None, :] - p[bad, None]).argmin(axis=1)]
    return y, p


def test_counts_and_never_predicted_classes():
    rng = np.random.default_rng(0)
    runs = {f"m{i}/seed0": retina_like(rng, {1, 4} if i < 5 else {4}) for i in range(6)}
    rep = degenerate_predictions(runs, 5, [f"grade {g}" for g in range(5)])
    for key, (y, p) in runs.items():
        assert (
            rep.counts[key] == np.bincount(p, minlength=5).tolist() and sum(rep.counts[key]) == 400
        )
        assert rep.label_counts[key] == np.bincount(y, minlength=5).tolist()
    assert rep.never_predicted["m0/seed0"] == [1, 4] and rep.never_predicted["m5/seed0"] == [4]
    assert rep.never_by_any == [4] and rep.degenerate
    assert rep.warnings[0].startswith(
        "grade 1: 5 of 6 runs never predict it (m0/seed0, m1/seed0, m2/seed0, m3/seed0, m4/seed0)"
    )
    assert rep.warnings[1] == (
        "grade 4: none of the 6 runs predicts it (20 examples of it in the evaluated data); "
        "its recall there is 0 by construction"
    )
    assert "never predicted by any run" in rep.warning_for(4) and rep.warning_for(0) is None
    assert "5 of 6 runs" in rep.warning_for(1)


def test_predictions_only_and_bad_input():
    rep = degenerate_predictions({"a": np.array([0, 0, 2])}, 3)
    assert (
        rep.counts == {"a": [2, 0, 1]}
        and rep.never_predicted == {"a": [1]}
        and rep.label_counts == {}
    )
    assert rep.warnings == [
        "class 1: run a never predicts it; its recall there is 0 by construction"
    ]
    assert not degenerate_predictions({"a": np.array([0, 1, 2])}, 3).degenerate
    with pytest.raises(ValueError, match="run a: predictions contain class 3"):
        degenerate_predictions({"a": np.array([0, 3])}, 3)
    with pytest.raises(ValueError, match="2 class names for 3 classes"):
        degenerate_predictions({"a": np.array([0])}, 3, ["x", "y"])


def test_zero_width_recall_interval_needs_the_warning():
    rng = np.random.default_rng(1)
    y, p = retina_like(rng, {1, 4})
    recall4 = lambda yy, pp: float(((pp == 4) & (yy == 4)).sum() / max(1, (yy == 4).sum()))  # noqa: E731
    ci = stats.bootstrap_ci(y, p, recall4, n_resamples=200, seed=0, num_classes=5)
    assert (ci.estimate, ci.low, ci.high) == (0.0, 0.0, 0.0)
    with pytest.raises(
        ZeroWidthIntervalError, match="zero-width interval 0.000 \\[0.000, 0.000\\] needs a warning"
    ):
        interval_text(ci.estimate, ci.low, ci.high, what="grade 4 recall")
    rep = degenerate_predictions({"m0/seed0": (y, p)}, 5, [f"grade {g}" for g in range(5)])
    text = interval_text(ci.estimate, ci.low, ci.high, warning=rep.warning_for(4))
    assert text.startswith(
        "0.000 [0.000, 0.000] (zero width: grade 4 is never predicted by any run"
    )
    assert interval_text(0.5, 0.4, 0.6) == "0.500 [0.400, 0.600]"
