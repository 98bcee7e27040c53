"""Attribution patching (AtP, AtP-IG) checked against the exact patching grid it estimates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from random_vits import random_vit
from test_interventions import BASE, images, make
from workbench.interventions import InterventionError
from workbench.data import NormStats
from workbench.interventions.attribution_patching import (
    agreement,
    comparison_metrics,
    estimate_batch,
    estimate_pairs,
    estimate_split,
    exact_passes,
    location_names,
    random_agreement,
    random_scores,
    read_locations,
    stated_passes,
)
from workbench.interventions.evaluate import Inputs
from workbench.interventions.patching import (
    DIRECTIONS,
    PATCHED,
    make_pairs,
    patch_batch,
    patch_split,
    readout_reads,
)
from workbench.protocol.intervention import PatchingSpec

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
    [
        ("atp", 5, "embedding"),
        ("atp_ig", 3, "embedding"),
        ("atp_ig", 3, "site"),
        ("atp_shuffled", 3, "embedding"),
    ],
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
    positions = [f"{d}position_{k}_change" for d in DIRECTIONS.values() for k in ("branch", "head")]
    assert sorted(est) == sorted(f"atp_ig_{k}" for k in KINDS + positions)
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


# ---- controls and the per-position split ----------------------------------------------------


def test_the_controls_score_near_zero_where_atp_scores_near_one():
    # A corruption of size eps: AtP is exact to first order, so it ranks the locations as exact
    # patching does (rho ~ 1). The shuffled-gradient AtP keeps every activation difference but
    # pairs it with another example's gradient at another place; random scores know nothing.
    # Both must rank near 0 on the same locations (20 shuffles, 100 random draws: their means).
    model = nonlinear_model().double()
    x, noise = images(8, seed=1).double(), images(8, seed=2).double()
    y, contrast = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), torch.tensor([3, 4, 0, 1, 2, 4, 0, 1])
    x_corrupt = x + 1e-2 * noise
    exact = patch_batch(model, x, x_corrupt, y, contrast)
    keep = read_locations(readout_reads(model, x), model.cfg.depth, model.cfg.heads)
    atp = estimate_batch(model, x, x_corrupt, y, contrast, "atp")
    scored = {d: agreement(exact, atp, "atp", d, keep).rho for d in DIRECTIONS}
    assert min(scored.values()) >= 0.99, f"AtP's rho {scored}: the case is not first-order"
    shuffled = {d: [] for d in DIRECTIONS}
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        est = estimate_batch(model, x, x_corrupt, y, contrast, "atp_shuffled", generator=gen)
        for d in DIRECTIONS:
            shuffled[d].append(agreement(exact, est, "atp_shuffled", d, keep).rho)
    locations = int(keep.sum())
    draws = random_scores(len(keep), seed=0)
    for d in DIRECTIONS:
        mean = float(np.mean(shuffled[d]))
        rand = float(np.mean([a.rho for a in random_agreement(exact, draws, d, keep)]))
        # one rho over n locations has sd ~ 1 / sqrt(n - 1) under no association: 0.15 here,
        # so a mean of 20 shuffles ~0.03 and of 100 draws ~0.015
        assert abs(mean) <= 0.15, (
            f"{d}: shuffled-gradient AtP mean rho {mean:+.3f} ({locations} locations)"
        )
        assert abs(rand) <= 0.1, f"{d}: random scores' mean rho {rand:+.3f}"
        assert scored[d] - mean >= 0.8, (d, scored[d], mean)


def test_the_shuffled_control_is_seeded_and_keeps_atps_activation_differences():
    # The same seed gives the same arrays, another seed others, and they are not AtP's; with no
    # activation difference (corrupted = clean) every location keeps its LD, as AtP's does.
    model, x, x_corrupt = make("plain"), images(3, seed=1), images(3, seed=2)

    def shuffled(x_corrupt, seed):
        gen = torch.Generator().manual_seed(seed)
        return estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp_shuffled", generator=gen)

    one, again, other = shuffled(x_corrupt, 4), shuffled(x_corrupt, 4), shuffled(x_corrupt, 5)
    for k in one:
        assert np.array_equal(one[k], again[k]), k
    assert any(not np.array_equal(one[k], other[k]) for k in one)
    atp = estimate_batch(model, x, x_corrupt, Y, CONTRAST, "atp")
    diff = np.abs(atp["atp_resid_ld"] - one["atp_shuffled_resid_ld"]).max()
    assert diff > 1e-4, f"the shuffle changed nothing: max |AtP - shuffled| {diff:.3g}"
    same = shuffled(x, 4)
    clean = patch_batch(model, x, x, Y, CONTRAST)["clean_ld"]
    for k in KINDS:
        gap = np.abs(same[f"atp_shuffled_{k}"] - clean[:, None, None]).max()
        assert gap <= 1e-5, f"{k}: no activation difference, yet the LD moved by {gap:.3g}"


def test_the_per_position_changes_sum_to_each_branch_and_head_and_the_heads_to_attention():
    # AtP is linear in the activation difference: a branch's estimate is the sum of its
    # per-position terms, and (attn = z W_O^T + b, so diff_attn . g = diff_z . W_O^T g) the heads'
    # per-position terms sum to the attention branch's, position by position.
    model = make("plain").double()
    x, x_corrupt = images(3, seed=1).double(), images(3, seed=2).double()
    for method in ("atp", "atp_ig"):
        est = estimate_batch(model, x, x_corrupt, Y, CONTRAST, method, 3)
        exact = patch_batch(model, x, x_corrupt, Y, CONTRAST)
        for d, prefix in DIRECTIONS.items():
            target = exact["corrupted_ld" if d == "denoising" else "clean_ld"][:, None]
            branch = est[f"{method}_{prefix}position_branch_change"]  # (B, depth, 2, N)
            head = est[f"{method}_{prefix}position_head_change"]  # (B, depth, heads, N)
            for kind, per in (("branch", branch), ("head", head)):
                change = est[f"{method}_{prefix}{kind}_ld"].astype(np.float64) - target[..., None]
                diff = np.abs(per.astype(np.float64).sum(axis=3) - change).max()
                scale = np.abs(change).max()
                assert diff <= 1e-5 * max(scale, 1.0), (method, d, kind, diff, scale)
            diff = np.abs(head.sum(axis=2) - branch[:, :, 0]).max()
            scale = np.abs(branch[:, :, 0]).max()
            assert diff <= 1e-5 * max(scale, 1.0), (method, d, "heads vs attn", diff, scale)


def test_estimate_split_acts_on_the_pairs_patch_split_patches():
    # The stratified sample draws other clean images than the uniform one; each AtP row must be
    # the exact grid's pair: at the last block a class-token head reads the class token only, so
    # AtP's LD at every other position there is the target run's LD of that same pair.
    model = make("plain", pooling="cls")
    gen = torch.Generator().manual_seed(3)
    uint8 = torch.randint(0, 256, (40, 3, 16, 16), dtype=torch.uint8, generator=gen)
    labels, indices = torch.arange(40) % 5, torch.arange(100, 140)
    inputs = Inputs(NormStats((0.5,) * 3, (0.25,) * 3), 4, torch.device("cpu"))
    spec = PatchingSpec(pairs=10, seed=1, attribution_patching=True, ig_steps=2)
    assert spec.sample == "stratified"
    result, logged = patch_split(model, uint8, labels, indices, inputs, spec)
    est = estimate_split(model, uint8, labels, indices, inputs, spec)
    for d, prefix in DIRECTIONS.items():
        target = result.corrupted_ld if d == "denoising" else result.clean_ld
        for method in ("atp", "atp_ig"):  # the control's shuffle puts gradients there
            diff = np.abs(est[f"{method}_{prefix}resid_ld"][:, -1, 1:] - target[:, None]).max()
            assert diff <= 1e-4, f"{method} {d}: rows are other pairs (max |diff| {diff:.3g})"
    # the check tells other pairs apart: the uniform draw's (what estimate_split acted on before)
    uniform = make_pairs(labels.numpy(), 10, 1, sample="uniform")
    assert not np.array_equal(uniform.clean + 100, logged["clean_index"])
    other = estimate_pairs(model, uint8, labels, uniform, inputs, "atp")["atp_resid_ld"]
    diff = np.abs(other[:, -1, 1:] - result.corrupted_ld[:, None]).max()
    assert diff > 1e-2, f"other pairs pass the check (max |diff| {diff:.3g})"
    assert est["random_scores"].shape == (100, 2 * (17 + 2 + 4))
    assert est["atp_passes"].tolist() == [2, 2] and est["atp_ig_passes"].tolist() == [4, 4]
    assert est["atp_position_head_change"].shape == (2, 4, 17)  # means over the pairs
    assert all(float(est[f"{m}_seconds"]) > 0 for m in ("atp", "atp_ig", "atp_shuffled"))
