"""Attribution patching (AtP, AtP-IG) checked against the exact patching grid it estimates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from random_vits import random_vit
from test_interventions import BASE, images, make
from workbench.interventions import InterventionError
from workbench.interventions.attribution_patching import (
    agreement,
    comparison_metrics,
    estimate_batch,
    exact_passes,
    location_names,
    read_locations,
    stated_passes,
)
from workbench.interventions.patching import DIRECTIONS, PATCHED, patch_batch, readout_reads

KINDS = [f"{d}{k}_ld" for d in DIRECTIONS.values() for k in PATCHED]
Y, CONTRAST = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])


def nonlinear_model():
    """Random weights at RMS 0.3 at the least: the patches move the LD far from linearly."""
    return random_vit(BASE, 0, floor=0.3)


def mean_abs_error(estimate: dict, exact: dict, method: str) -> float:
    return float(np.mean([np.abs(estimate[f"{method}_{k}"] - exact[k]).mean() for k in KINDS]))


def test_atp_is_exact_patching_to_first_order_when_the_corruption_is_tiny():
    # LD is smooth, so for a corruption of size eps the patch effects are O(eps) and AtP's
    # error O(eps^2): relative to the effects it shrinks like eps (measured: 1.3e-2 at 1e-2,
    # 1.2e-3 at 1e-3; the arrays are float32, which floors it near 1e-4 below that).
    model = nonlinear_model().double()
    x = images(3, seed=1).double()
    noise = images(3, seed=2).double()
    for eps, tolerance in [(1e-2, 3e-2), (1e-3, 3e-3)]:
        x_corrupt = x + eps * noise
        exact = patch_batch(model, x, x_corrupt, Y, CONTRAST)
        est = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp")
        for k in KINDS:
            target = exact["corrupted_ld" if not k.startswith("noising") else "clean_ld"]
            effect = np.abs(exact[k] - target[:, None, None]).max()
            diff = np.abs(est[f"atp_{k}"].astype(np.float64) - exact[k]).max()
            assert effect > 0, f"{k}: the corruption moved nothing"
            assert diff <= tolerance * effect, (
                f"eps={eps} {k}: max |AtP - exact| {diff:.3g} > {tolerance} x max effect {effect:.3g}"
            )


def test_atp_is_not_exact_on_a_real_corruption_and_integrated_gradients_come_closer():
    model, x, x_corrupt = nonlinear_model(), images(3, seed=1), images(3, seed=2)
    exact = patch_batch(model, x, x_corrupt, Y, CONTRAST)
    atp = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp")
    atp_error = mean_abs_error(atp, exact, "atp")
    assert atp_error > 1e-3, f"AtP mean |error| {atp_error:.3g}: the case is not nonlinear"
    for path in ("embedding", "site"):
        ig = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp_ig", 5, path)
        ig_error = mean_abs_error(ig, exact, "atp_ig")
        assert ig_error < 0.9 * atp_error, (
            f"{path}: AtP-IG mean |error| {ig_error:.4g} not below AtP's {atp_error:.4g}"
        )


@pytest.mark.parametrize("path", ["embedding", "site"])
def test_atp_ig_with_one_step_is_atp(path):
    model, x, x_corrupt = nonlinear_model(), images(3, seed=1), images(3, seed=2)
    atp = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp")
    ig = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp_ig", 1, path)
    for k in KINDS:
        diff = np.abs(ig[f"atp_ig_{k}"] - atp[f"atp_{k}"]).max()
        assert diff == 0.0, f"{path} {k}: AtP-IG at 1 step vs AtP: max |diff| {diff:.3g}"


class Passes:
    """Counts the model's forwards (full or from a block on) and backwards at its classifier."""

    def __init__(self, model):
        self.forward = self.backward = 0
        self.handles = [
            model.head.register_forward_hook(lambda *_: self.bump("forward")),
            model.head.register_full_backward_hook(lambda *_: self.bump("backward")),
        ]

    def bump(self, which: str) -> None:
        setattr(self, which, getattr(self, which) + 1)

    def close(self) -> dict:
        for h in self.handles:
            h.remove()
        return {"forward": self.forward, "backward": self.backward}


@pytest.mark.parametrize(
    "method, steps, path",
    [("atp", 5, "embedding"), ("atp_ig", 3, "embedding"), ("atp_ig", 3, "site")],
)
def test_the_passes_are_those_stated(method, steps, path):
    model, x, x_corrupt = make("plain"), images(3, seed=1), images(3, seed=2)
    counter = Passes(model)
    estimate_batch(model, x, x_corrupt, Y, CONTRAST, method, steps, path)
    counted = counter.close()
    stated = stated_passes(method, steps, model.cfg.depth, path)
    assert counted == stated, f"{method} {path} {steps} steps: counted {counted}, stated {stated}"
    counter = Passes(model)
    patch_batch(model, x, x_corrupt, Y, CONTRAST)
    counted = counter.close()
    tokens = model.cfg.num_patches + 1
    assert counted == exact_passes(model.cfg.depth, tokens, model.cfg.heads), counted


@pytest.mark.parametrize("family", ["plain", "layerscale_registers", "clip_like_swiglu"])
def test_the_estimates_have_the_exact_grids_layout(family):
    model, x, x_corrupt = make(family), images(3, seed=1), images(3, seed=2)
    exact = patch_batch(model, x, x_corrupt, Y, CONTRAST)
    est = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp_ig", 2)
    assert sorted(est) == sorted(f"atp_ig_{k}" for k in KINDS)
    for k in KINDS:
        assert est[f"atp_ig_{k}"].shape == exact[k].shape, (k, est[f"atp_ig_{k}"].shape)
    depth, tokens = exact["resid_ld"].shape[1:]
    names = location_names(depth, tokens, model.cfg.heads)
    assert len(names) == depth * (tokens + 2 + model.cfg.heads) == len(set(names))


def test_agreement_is_perfect_on_the_exact_patches_and_finds_a_planted_disagreement():
    model, x, x_corrupt = nonlinear_model(), images(3, seed=1), images(3, seed=2)
    exact = patch_batch(model, x, x_corrupt, Y, CONTRAST)
    itself = {f"atp_{k}": exact[k] for k in KINDS}
    same = agreement(exact, itself, "atp")
    assert (same.rho, same.top_overlap, same.sign_agreement) == (1.0, 1.0, 1.0), same
    planted = {k: v.copy() for k, v in itself.items()}
    planted["atp_head_ld"][:, 1, 2] += 50.0  # blocks.1.attn.head2, every pair
    bad = agreement(exact, planted, "atp")
    assert bad.worst[0][0] == "blocks.1.attn.head2", bad.worst
    gen = np.random.default_rng(0)
    shuffled = {k: gen.permutation(v.reshape(-1)).reshape(v.shape) for k, v in itself.items()}
    noise = agreement(exact, shuffled, "atp")
    assert noise.rho < 0.5 and noise.sign_agreement < 1.0, noise.metrics()
    reads = np.ones(exact["resid_ld"].shape[1:], dtype=bool)
    reads[0, 0] = False
    keep = read_locations(reads, model.cfg.depth, model.cfg.heads)
    assert agreement(exact, itself, "atp", keep=keep).locations == same.locations - 1


def test_bad_settings_are_refused_in_one_line():
    model, x = make("plain"), images(3, seed=1)
    with pytest.raises(InterventionError, match="method 'atp2'"):
        estimate_batch(model, x, x, Y, CONTRAST, "atp2")
    with pytest.raises(InterventionError, match="steps=0"):
        estimate_batch(model, x, x, Y, CONTRAST, "atp_ig", 0)
    with pytest.raises(InterventionError, match="ig_path 'input'"):
        estimate_batch(model, x, x, Y, CONTRAST, "atp_ig", 2, "input")


def test_the_logged_comparison_is_the_agreement_over_the_read_locations_with_the_passes():
    model, x, x_corrupt = make("plain"), images(3, seed=1), images(3, seed=2)
    exact = patch_batch(model, x, x_corrupt, Y, CONTRAST)
    est = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp") | estimate_batch(
        model, x, x_corrupt, Y, CONTRAST, "atp_ig", 4
    )
    reads = readout_reads(model, x)
    logged = comparison_metrics(exact, est, reads, model, 4)
    keep = read_locations(reads, model.cfg.depth, model.cfg.heads)
    assert keep.sum() < keep.size, "a class-token head leaves the last block's patches unread"
    for method in ("atp", "atp_ig"):
        for direction in DIRECTIONS:
            expected = agreement(exact, est, method, direction, keep).metrics()
            for name, value in expected.items():
                got = logged[f"{method}_{name}/{direction}"]
                assert got == value or (np.isnan(got) and np.isnan(value)), (name, got, value)
    assert (logged["atp_forwards"], logged["atp_ig_forwards"], logged["atp_ig_backwards"]) == (
        2.0,
        8.0,
        8.0,
    )
    assert logged["exact_forwards"] == 2 + 2 * 2 * (17 + 2 + 4)
