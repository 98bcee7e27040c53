"""Activation patching: the pairs, the corruption, and the grid checked against plain hooked forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_interventions import images, make
from workbench.interventions import InterventionError, run_with_hooks
from workbench.interventions.patching import (
    corrupt,
    fixed_by_construction,
    make_pairs,
    patch_batch,
    readout_reads,
    removed_fraction,
    restored_fraction,
)


def test_pairs_are_seeded_and_each_corrupting_image_is_of_another_class():
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    a = make_pairs(labels, 5, 3, corruption="patches", replaced_patches=2, num_patches=16)
    b = make_pairs(labels, 5, 3, corruption="patches", replaced_patches=2, num_patches=16)
    assert all(
        np.array_equal(getattr(a, k), getattr(b, k)) for k in ("clean", "source", "replaced")
    )
    assert np.all(labels[a.clean] != labels[a.source]) and len(set(a.clean)) == 5
    assert a.replaced.shape == (5, 2) and np.all(a.replaced < 16)
    assert make_pairs(labels, 5, 3).replaced.shape == (5, 0)
    with pytest.raises(InterventionError, match="replaced_patches=17: must be 1 to the model's 16"):
        make_pairs(labels, 2, 0, corruption="patches", replaced_patches=17, num_patches=16)
    with pytest.raises(InterventionError, match="at least 2 classes"):
        make_pairs(np.zeros(4, dtype=int), 2, 0)


def test_a_patch_corruption_replaces_exactly_the_listed_patches():
    model = make("plain")  # 16 px, patch 4: a 4 x 4 grid
    clean, source = images(2, seed=1), images(2, seed=2)
    out = corrupt(clean, source, np.array([[0, 5], [15, 3]]), model.cfg)
    changed = (out != clean).any(dim=1)  # (B, H, W)
    expected = torch.zeros_like(changed)
    for b, patches in enumerate([[0, 5], [15, 3]]):
        for p in patches:
            r, c = divmod(p, 4)
            expected[b, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] = True
    assert torch.equal(changed, expected)


@pytest.mark.parametrize("family", ["plain", "layerscale_registers", "qk_norm_inner_norms"])
def test_every_patch_is_the_corrupted_forward_with_that_clean_activation_hooked_in(family):
    model = make(family)
    x_clean, x_corrupt = images(3, seed=1), images(3, seed=2)
    y, contrast = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])
    out = patch_batch(model, x_clean, x_corrupt, y, contrast)

    def ld(logits):
        return (logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None]))[:, 0].numpy()

    def close(actual, expected, what):
        diff = float(np.abs(actual - expected).max())
        assert diff <= 1e-5, f"{family} {what}: max diff {diff}"

    with torch.no_grad():
        close(out["clean_ld"], ld(model(x_clean)), "clean")
        close(out["corrupted_ld"], ld(model(x_corrupt)), "corrupted")
        acts = {}
        run_with_hooks(
            model,
            x_clean,
            [
                (n, lambda a, h: acts.__setitem__(h.name, a))
                for n in ("blocks.0.resid2", "blocks.1.mlp", "blocks.1.attn.z")
            ],
        )

        def at_token(a, h, t=2):
            a = a.clone()
            a[:, t] = acts["blocks.0.resid2"][:, t]
            return a

        close(
            out["resid_ld"][:, 0, 2],
            ld(run_with_hooks(model, x_corrupt, [("blocks.0.resid2", at_token)])),
            "resid",
        )
        close(
            out["branch_ld"][:, 1, 1],
            ld(
                run_with_hooks(
                    model, x_corrupt, [("blocks.1.mlp", lambda a, h: acts["blocks.1.mlp"])]
                )
            ),
            "mlp",
        )

        def head3(a, h):
            a = a.clone()
            a[:, :, 3] = acts["blocks.1.attn.z"][:, :, 3]
            return a

        close(
            out["head_ld"][:, 1, 3],
            ld(run_with_hooks(model, x_corrupt, [("blocks.1.attn.z", head3)])),
            "head",
        )
    # the class token at the last block's output is everything a CLS-pooled head reads
    last = model.cfg.depth - 1
    close(out["resid_ld"][:, last, 0], out["clean_ld"], "CLS at the last block")
    if model.cfg.pooling == "cls":
        close(out["resid_ld"][:, last, -1], out["corrupted_ld"], "a patch token at the last block")
    frac = restored_fraction(out["resid_ld"], out["clean_ld"], out["corrupted_ld"])
    assert abs(frac[last, 0] - 1.0) <= 1e-5 and frac.shape == out["resid_ld"].shape[1:]


@pytest.mark.parametrize("family", ["plain", "layerscale_registers"])
def test_noising_is_the_clean_forward_with_that_corrupted_activation_hooked_in(family):
    model = make(family)
    x_clean, x_corrupt = images(3, seed=1), images(3, seed=2)
    y, contrast = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])
    out = patch_batch(model, x_clean, x_corrupt, y, contrast)

    def ld(logits):
        return (logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None]))[:, 0].numpy()

    def close(actual, expected, what):
        diff = float(np.abs(actual - expected).max())
        assert diff <= 1e-5, f"{family} {what}: max diff {diff}"

    with torch.no_grad():
        acts = {}
        run_with_hooks(
            model,
            x_corrupt,
            [
                (n, lambda a, h: acts.__setitem__(h.name, a))
                for n in ("blocks.0.resid2", "blocks.1.attn")
            ],
        )

        def at_token(a, h, t=1):
            a = a.clone()
            a[:, t] = acts["blocks.0.resid2"][:, t]
            return a

        close(
            out["noising_resid_ld"][:, 0, 1],
            ld(run_with_hooks(model, x_clean, [("blocks.0.resid2", at_token)])),
            "noising resid",
        )
        close(
            out["noising_branch_ld"][:, 1, 0],
            ld(
                run_with_hooks(
                    model, x_clean, [("blocks.1.attn", lambda a, h: acts["blocks.1.attn"])]
                )
            ),
            "noising attn",
        )
    # the directions differ: denoising and noising the same location are not the same run
    assert float(np.abs(out["noising_resid_ld"] - out["resid_ld"]).max()) > 1e-3
    last = model.cfg.depth - 1
    removed = removed_fraction(out["noising_resid_ld"], out["clean_ld"], out["corrupted_ld"])
    assert abs(removed[last, 0] - 1.0) <= 1e-5  # the whole readout replaced: all of it removed
    assert float(np.abs(removed[last, 1:]).max()) <= 1e-5  # a position the head never reads


@pytest.mark.parametrize(
    "family, fixed_last",
    [("plain", "all"), ("layerscale_registers", "all"), ("mean_pooling", "none")],
)
def test_the_locations_fixed_by_construction_come_from_the_model(family, fixed_last):
    model = make(family)
    x = images(3, seed=1)
    reads = readout_reads(model, x)
    depth, tokens = model.cfg.depth, model.cfg.num_patches + model.cfg.num_prefix_tokens
    assert reads.shape == (depth, tokens)
    assert reads[:-1].all(), "attention mixes every position before the last block"
    fixed = fixed_by_construction(reads)
    assert not fixed[:-1].any()
    if fixed_last == "all":  # a class-token head: the last block's class token is all it reads
        assert reads[-1].tolist() == [True] + [False] * (tokens - 1)
        assert fixed[-1].all()
    else:  # a mean-pooling head reads every patch (not the class token): none of them is fixed
        assert reads[-1].tolist() == [False] + [True] * (tokens - 1)
        assert fixed[-1].tolist() == [True] + [False] * (tokens - 1)
    # and the fixed values are what the patching measures exactly: 0 off the readout, 1 on it
    y, contrast = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])
    out = patch_batch(model, x, images(3, seed=2), y, contrast)
    frac = restored_fraction(out["resid_ld"], out["clean_ld"], out["corrupted_ld"])
    want = np.where(reads, 1.0, 0.0)
    gap = float(np.abs(frac[fixed] - want[fixed]).max()) if fixed.any() else 0.0
    assert gap <= 1e-5, f"fixed locations off their value by {gap}"
    if fixed_last == "none":
        assert float(np.abs(frac[-1, 1:]).min()) > 1e-4  # not fixed: values of their own


def test_a_position_the_readout_reads_is_not_called_fixed_and_one_alone_is():
    reads = np.array([[True, True, True], [True, False, False], [False, False, False]])
    fixed = fixed_by_construction(reads)
    assert fixed.tolist() == [[False] * 3, [True] * 3, [True] * 3]


def synthetic_cells(seeds=5, pairs=8, depth=3, tokens=6, with_reads=True):
    """Seed maps that agree only where the model fixes them: the last block (class token 1, patches 0)."""
    rng = np.random.default_rng(0)
    cells = {}
    for s in range(seeds):
        clean, corrupted = rng.normal(3, 0.1, pairs), rng.normal(-3, 0.1, pairs)
        resid = rng.normal(size=(pairs, depth, tokens))  # independent per seed: no agreement
        resid[:, -1, 0], resid[:, -1, 1:] = clean, corrupted[:, None]  # fixed by construction
        z = {"clean_ld": clean, "corrupted_ld": corrupted, "resid_ld": resid}
        if with_reads:
            reads = np.ones((depth, tokens), dtype=bool)
            reads[-1, 1:] = False
            z["resid_reads"] = reads
        cells[s] = z
    return cells


def test_seed_agreement_leaves_out_what_the_model_fixes_and_the_old_reading_did_not():
    from reports.interventions import patching_report

    cells = synthetic_cells()
    maps = patching_report.effect_maps(cells, "resid")
    everything = patching_report.spearman_pairs(maps)  # the reading before issue 48
    fixed, from_model = patching_report.fixed_locations(cells)
    assert from_model and fixed[-1].all() and not fixed[:-1].any()
    free = patching_report.spearman_pairs(maps, ~fixed)
    # the fixed block alone makes unrelated maps look alike; left out, they do not
    assert np.mean(everything) > 0.4 and abs(np.mean(free)) < 0.2, (everything, free)
    blocks = patching_report.agreement_blocks(cells, "vit", 3)[1:]
    rows = blocks[1].rows
    assert rows[-2][:3] == ["2", "0 of 6", "n/a"] and rows[-1][1] == "12 of 18"
    assert "predates noising" in blocks[0].text  # these cells ran denoising only
    # evidence without the model's map: the same locations, found bitwise in the data
    old = synthetic_cells(with_reads=False)
    again, from_model = patching_report.fixed_locations(old)
    assert not from_model and np.array_equal(again, fixed)
    assert "found in the data" in patching_report.agreement_blocks(old, "vit", 3)[1].text


@pytest.mark.parametrize("family", ["plain", "layerscale_registers"])
def test_a_branch_or_head_patched_at_one_position_is_the_hooked_forward_in_both_directions(
    family,
):
    model = make(family)
    x_clean, x_corrupt = images(3, seed=1), images(3, seed=2)
    y, contrast = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])
    out = patch_batch(model, x_clean, x_corrupt, y, contrast, positions=True)
    depth, heads, tokens = model.cfg.depth, model.cfg.heads, out["resid_ld"].shape[2]
    assert out["branch_pos_ld"].shape == (3, depth, 2, tokens)
    assert out["noising_head_pos_ld"].shape == (3, depth, heads, tokens)

    def ld(logits):
        return (logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None]))[:, 0].numpy()

    def close(actual, expected, what):
        diff = float(np.abs(actual - expected).max())
        assert diff <= 1e-5, f"{family} {what}: max diff {diff}"

    with torch.no_grad():
        for target, source, prefix in ((x_corrupt, x_clean, ""), (x_clean, x_corrupt, "noising_")):
            acts = {}
            run_with_hooks(
                model,
                source,
                [
                    (n, lambda a, h, acts=acts: acts.__setitem__(h.name, a))
                    for n in ("blocks.0.attn", "blocks.1.attn.z")
                ],
            )

            def attn_at(a, h, t=1, acts=acts):
                a = a.clone()
                a[:, t] = acts["blocks.0.attn"][:, t]
                return a

            def head_at(a, h, t=tokens - 1, k=heads - 1, acts=acts):
                a = a.clone()
                a[:, t, k] = acts["blocks.1.attn.z"][:, t, k]
                return a

            close(
                out[f"{prefix}branch_pos_ld"][:, 0, 0, 1],
                ld(run_with_hooks(model, target, [("blocks.0.attn", attn_at)])),
                f"{prefix}attn at token 1",
            )
            close(
                out[f"{prefix}head_pos_ld"][:, 1, heads - 1, tokens - 1],
                ld(run_with_hooks(model, target, [("blocks.1.attn.z", head_at)])),
                f"{prefix}last head at the last token",
            )
    # without ``positions`` the arrays are absent and the rest of the grid is unchanged
    without = patch_batch(model, x_clean, x_corrupt, y, contrast)
    assert "branch_pos_ld" not in without
    assert np.array_equal(without["resid_ld"], out["resid_ld"])


def test_a_patch_corruption_is_read_at_each_pairs_own_replaced_and_untouched_patches():
    from reports.interventions.patch_localisation import localisation, replaced_tokens

    # 2 pairs, 1 block, a class token and 4 patches; pair 0 replaced patches 0 and 2, pair 1 patch 3
    replaced = np.array([[0, 2], [3, 3]])  # a repeated index counts once in the mask
    mask = replaced_tokens(replaced, tokens=5, prefix=1)
    assert mask.tolist() == [[False, True, False, True, False], [False, False, False, False, True]]
    z = {
        "clean_ld": np.array([4.0, 6.0]),
        "corrupted_ld": np.array([0.0, 2.0]),
        "replaced": np.array([[0, 2], [3, 1]]),
        "resid_ld": np.array([[[1.0, 3.0, 0.0, 4.0, 1.0]], [[2.0, 2.0, 5.0, 2.0, 6.0]]]),
        "noising_resid_ld": np.array([[[4.0, 2.0, 4.0, 2.0, 4.0]], [[6.0, 6.0, 3.0, 6.0, 2.0]]]),
    }
    got = localisation(z, prefix=1)
    gap = 4.0  # mean clean 5 - mean corrupted 1
    # per pair: replaced mean (3 + 4) / 2 = 3.5 and (5 + 6) / 2 = 5.5; untouched (0 + 1) / 2 = 0.5
    # and (2 + 2) / 2 = 2; class token 1 and 2
    assert got["replaced"][0] == pytest.approx((4.5 - 1.0) / gap)
    assert got["untouched"][0] == pytest.approx((1.25 - 1.0) / gap)
    assert got["prefix"][0] == pytest.approx((1.5 - 1.0) / gap)
    removed = localisation(z, prefix=1, direction="noising")
    # noising replaced: (2 + 2) / 2 = 2 and (3 + 2) / 2 = 2.5 -> mean 2.25; removed (5 - 2.25) / 4
    assert removed["replaced"][0] == pytest.approx((5.0 - 2.25) / gap)
