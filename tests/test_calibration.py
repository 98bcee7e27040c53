"""Calibration from saved predictions: ECE, NLL and Brier against hand-computed values, temperature scaling."""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.special import softmax

from reports.calibration.calibration_blocks import calibration_blocks, cell_calibration
from reports.render import Para, Table, to_markdown
from workbench.calibration import brier, calibrate, ece, fit_temperature, log_probs, nll, scaled

# Four examples, two classes. Confidences 0.95 and 0.94 share bin 14 of 15 ((14/15, 1]), 0.72 is
# in bin 10 ((10/15, 11/15]), 0.61 in bin 9; predicted [0, 1, 0, 1], correct [1, 0, 0, 1].
PROBS = np.array([[0.95, 0.05], [0.06, 0.94], [0.72, 0.28], [0.39, 0.61]])
LABELS = np.array([0, 0, 1, 1])


def test_ece_nll_brier_equal_hand_computed_values():
    # ECE: bin 14: accuracy 1/2, confidence 0.945, weight 2/4 -> 0.2225; bin 10: 0.72 x 1/4 =
    # 0.18; bin 9: (1 - 0.61) x 1/4 = 0.0975; total 0.5.
    assert abs(ece(PROBS, LABELS) - 0.5) < 1e-12, ece(PROBS, LABELS)
    # NLL: -(ln 0.95 + ln 0.06 + ln 0.28 + ln 0.61) / 4 = (0.051293 + 2.813411 + 1.272966 + 0.494296) / 4
    assert abs(nll(PROBS, LABELS) - 1.1579915) < 1e-6, nll(PROBS, LABELS)
    # Brier: (0.005 + 1.7672 + 1.0368 + 0.3042) / 4 = 0.7783
    assert abs(brier(PROBS, LABELS) - 0.7783) < 1e-12, brier(PROBS, LABELS)
    # A perfect, certain classifier: all three are 0.
    eye = np.eye(3)
    assert ece(eye, np.arange(3)) == 0.0 and brier(eye, np.arange(3)) == 0.0
    assert nll(eye, np.arange(3)) == 0.0


def overconfident(n: int, seed: int, sharpen: float = 3.0):
    """Labels drawn from softmax(u); the 'model' says softmax(sharpen * u): T = sharpen undoes it."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(n, 5))
    labels = np.array([rng.choice(5, p=p) for p in softmax(u, axis=1)])
    return softmax(sharpen * u, axis=1), labels, sharpen * u


def test_the_fitted_temperature_undoes_a_known_sharpening_and_minimises_the_nll():
    probs, labels, logits = overconfident(20_000, 0)
    t = fit_temperature(log_probs(probs), labels)
    assert abs(t - 3.0) < 0.1, t  # sampling error of 20,000 draws: about 0.03
    loss = lambda temp: nll(scaled(log_probs(probs), temp), labels)  # noqa: E731
    assert loss(t) <= min(loss(t * 0.98), loss(t * 1.02)), (loss(t), t)
    # Scaling log-probabilities is scaling logits: they differ by a per-example constant.
    diff = np.abs(scaled(log_probs(probs), t) - softmax(logits / t, axis=1)).max()
    assert diff < 1e-9, diff


def test_calibrate_scores_test_with_the_validation_temperature_or_cross_fits_validation():
    val, val_labels, _ = overconfident(4_000, 1)
    test, test_labels, _ = overconfident(4_000, 2)
    c = calibrate(val, val_labels, test, test_labels)
    assert (c.split, c.fitted_on, c.examples) == ("test", "val", 4_000)
    assert abs(c.before["nll"] - nll(test, test_labels)) < 1e-12
    expected_after = nll(scaled(log_probs(test), c.temperature), test_labels)
    assert abs(c.after["nll"] - expected_after) < 1e-12
    assert c.after["nll"] < c.before["nll"] and c.after["ece"] < c.before["ece"], c
    alone = calibrate(val, val_labels)
    assert (alone.split, alone.fitted_on) == ("val", "val (cross-fitted halves)")
    assert alone.after["nll"] < alone.before["nll"], alone


def test_the_section_renders_cells_means_and_seed_paired_differences():
    tables = {}
    for arm, sharpen in (("vit", 1.0), ("cnn", 3.0)):
        for seed in (0, 1, 2):
            probs, labels, _ = overconfident(600, 10 + seed, sharpen)
            table = pd.DataFrame({"index": np.arange(600), "label": labels})
            for k in range(5):
                table[f"prob_{k}"] = probs[:, k]
            tables[(arm, seed)] = {"val": table.iloc[:300], "test": table.iloc[300:]}
    cells = {key: cell_calibration(t) for key, t in tables.items()}
    blocks = calibration_blocks(cells, ["vit", "cnn"], [("cnn", "vit")])
    md = to_markdown(blocks)
    assert "## Calibration" in md and md.count("| test ") == 6, md
    (paired,) = [b for b in blocks if isinstance(b, Table) and b.header[0] == "pair"]
    before_nll = next(r for r in paired.rows if r[1] == "before" and r[2] == "NLL")
    # The sharpened arm is worse calibrated before scaling in every seed: its difference is positive.
    assert before_nll[3].startswith("+") and before_nll[4] == "0 of 3", before_nll
    assert cell_calibration({"val": tables[("vit", 0)]["val"][["index", "label"]]}) is None
    empty = calibration_blocks({}, ["vit"], [], absent="no probabilities here")
    assert isinstance(empty[-1], Para) and empty[-1].text == "no probabilities here"
