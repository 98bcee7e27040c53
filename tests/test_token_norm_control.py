"""The high-norm token detector's positive control (issue 48 [AA] item 3): a token planted at a known
multiple of the block's median norm must be flagged once the multiple clears k, never below it,
and nothing is flagged in a model without such tokens; a detector that cannot fire fails the control,
and the report says which it was."""

from __future__ import annotations

import dataclasses
import importlib
import math

import numpy as np
import pytest
import torch
from random_vits import random_vit, tiny_config

from reports.attribution.attribution_report import norm_control_failures, norm_control_paras
from tracking.kinds.attribution_runs import AttributionCellResult
from workbench.attribution.token_norms import PLANTED_STEPS, PlantedControl, planted_control

BASE = tiny_config(image_size=8, patch_size=2, in_channels=1, num_classes=3, heads=2)  # 16 patches
K = 10.0
# the module (the package's ``token_norms`` is the function of that name)
NORMS = importlib.import_module("workbench.attribution.token_norms")


def images(n: int = 16) -> torch.Tensor:
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", [{}, {"register_tokens": 2}])
def test_a_planted_token_is_flagged_from_just_above_k_and_nothing_is_flagged_without_one(family):
    model = random_vit({**BASE, **family}, 0, floor=0.3)
    c = planted_control(model, images(), k=K)
    assert (c.block, c.position, c.images) == (1, 8, 16), c
    # negative side: this random model has no token above 10 x its block median, and the plant
    # leaves every other token unflagged
    assert c.clean_flagged == 0.0 and (c.others_flagged == 0).all(), c
    below, above = c.ratios < K, c.ratios > K
    assert (c.flagged[below] == 0).all() and (c.flagged[above] == 1).all(), (
        f"flagged share per ratio: {dict(zip(c.ratios.tolist(), c.flagged.tolist()))}"
    )
    # the detection threshold docs/attribution.md states: the ladder's first step above k
    assert c.threshold == pytest.approx(K * 1.01, abs=1e-12) and c.detects, c.threshold
    assert list(c.ratios) == pytest.approx([K * s for s in PLANTED_STEPS], abs=1e-12)


def test_a_detector_that_cannot_fire_fails_its_positive_control(monkeypatch):
    """The bad case: a detector whose cut is never reached (its outliers always empty) must fail
    the control, with no threshold; one that flags below k fails too."""
    model, real = random_vit(BASE, 0, floor=0.3), NORMS.token_norms

    def blind(*args, **kwargs):
        found = real(*args, **kwargs)
        return dataclasses.replace(found, outlier=np.zeros_like(found.outlier))

    monkeypatch.setattr(NORMS, "token_norms", blind)
    c = planted_control(model, images(8), k=K)
    assert not c.detects and math.isnan(c.threshold) and (c.flagged == 0).all(), c
    eager = dataclasses.replace(c, flagged=np.ones_like(c.flagged))  # flags every ratio, 2 x too
    assert not eager.detects and eager.threshold == pytest.approx(2.0), eager


def cells_of(control: PlantedControl | None) -> dict[int, AttributionCellResult]:
    arrays = {"norm_threshold": np.float64(K)}
    arrays |= control.arrays() if control is not None else {}
    return {0: AttributionCellResult(None, arrays)}


def test_the_report_says_the_detector_was_shown_to_detect_and_warns_when_it_was_not(monkeypatch):
    good = planted_control(random_vit(BASE, 0, floor=0.3), images(8), k=K)
    again = PlantedControl.from_arrays(good.arrays(), K)
    assert (
        again.detects and np.array_equal(again.flagged, good.flagged) and again.block == good.block
    )
    [para] = norm_control_paras(cells_of(good))
    # 8 images: the plant moves the median a little more than with 16, so the threshold is 10.5 x here
    assert K < good.threshold <= 1.05 * K, good.threshold
    assert "The detector was shown to detect" in para.text, para.text
    assert f"flagged in every image from {good.threshold:.2f} ×, none below 10 ×" in para.text, (
        para.text
    )
    assert norm_control_failures("vit", cells_of(good)) == []
    blind = dataclasses.replace(good, flagged=np.zeros_like(good.flagged))
    [para] = norm_control_paras(cells_of(blind))
    assert "⚠ The detector failed its positive control" in para.text, para.text
    [warning] = norm_control_failures("vit", cells_of(blind))
    assert warning.startswith(
        "vit/seed0: the high-norm detector failed its planted positive control"
    )
    # evidence exported before the control existed: nothing said, nothing warned
    assert (
        norm_control_paras(cells_of(None)) == []
        and norm_control_failures("vit", cells_of(None)) == []
    )
