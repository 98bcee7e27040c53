"""Activation patching: the pairs, the corruption, and the grid checked against plain hooked forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_interventions import images, make
from workbench.interventions import InterventionError, run_with_hooks
from workbench.interventions.patching import (
    corrupt,
    make_pairs,
    patch_batch,
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
