"""Edge patching (head -> class-token reader): exact path patching against forwards built another way
(a norm's input moved by monkeypatching the module, the final residual moved by a hook), edge AtP's
gradient against autograd at the final residual, and AtP against exact on a tiny corruption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

from test_interventions import images, make
from workbench.interventions import InterventionError, run_with_hooks
from workbench.interventions.edge_patching import edge_passes, edge_patch_batch, edges

FAMILIES = ["plain", "layerscale_registers"]


def ld(logits, y, contrast):
    return (logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None]))[:, 0]


def head_deltas(model, x_clean, x_corrupt):
    """Each head's clean-minus-corrupted write at the class token, from the model's own cache
    (``ActivationCache.stack_head_results``): {(block, head): (B, D)}."""
    _, clean = model.run_with_cache(x_clean)
    _, corr = model.run_with_cache(x_corrupt)
    depth, heads = model.cfg.depth, model.cfg.heads
    a = clean.stack_head_results(layer=depth, pos_slice=0)  # (L*H, B, D)
    b = corr.stack_head_results(layer=depth, pos_slice=0)
    return {(i, h): (a - b)[i * heads + h] for i in range(depth) for h in range(heads)}, corr


@pytest.mark.parametrize("family", FAMILIES)
def test_each_exact_edge_is_the_corrupted_forward_with_only_that_readers_input_moved(family):
    model = make(family)
    x_clean, x_corrupt = images(3, seed=1), images(3, seed=2)
    y, contrast = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])
    out = edge_patch_batch(model, x_clean, x_corrupt, y, contrast)
    found = edges(model)
    depth, heads = model.cfg.depth, model.cfg.heads
    assert out["edge_exact_ld"].shape == (3, len(found))
    assert len(found) == heads * sum(2 * (depth - i) for i in range(depth))  # mlp.i .. readout
    deltas, _ = head_deltas(model, x_clean, x_corrupt)
    with torch.no_grad():
        base = ld(model(x_corrupt), y, contrast)
        for k, e in enumerate(found):
            delta = deltas[(e.block, e.head)]
            if e.reader == "readout":  # the final residual's only reader: move it there
                last = f"blocks.{depth - 1}.resid2"

                def add(a, h, delta=delta):
                    a = a.clone()
                    a[:, 0] += delta
                    return a

                patched = run_with_hooks(model, x_corrupt, [(last, add)])
            else:  # the reader's norm sees its input moved at the class token, nothing else does
                kind, j = e.reader.split(".")
                norm = getattr(model.blocks[int(j)], "norm1" if kind == "attn" else "norm2")
                plain = norm.forward
                pad = torch.zeros(3, model.cfg.num_prefix_tokens + 16, delta.shape[-1])
                pad[:, 0] = delta
                norm.forward = lambda t, plain=plain, pad=pad: plain(t + pad)
                try:
                    patched = model(x_corrupt)
                finally:
                    del norm.forward
            expected = (ld(patched, y, contrast) - base).numpy()
            diff = float(np.abs(out["edge_exact_ld"][:, k] - expected).max())
            assert diff <= 1e-5, f"{family} {e.label}: max diff {diff}"


def test_edge_atp_is_the_gradient_at_the_readers_input_times_the_heads_write():
    model = make("plain")
    x_clean, x_corrupt = images(3, seed=1), images(3, seed=2)
    y, contrast = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])
    out = edge_patch_batch(model, x_clean, x_corrupt, y, contrast)
    deltas, _ = head_deltas(model, x_clean, x_corrupt)
    last = f"blocks.{model.cfg.depth - 1}.resid2"
    held = {}

    def keep(a, h):
        a.retain_grad()
        held["resid"] = a
        return a

    ld(run_with_hooks(model, x_corrupt, [(last, keep)]), y, contrast).sum().backward()
    g = held["resid"].grad[:, 0]  # the readout is the final residual's only reader
    for k, e in enumerate(edges(model)):
        if e.reader == "readout":
            expected = (g * deltas[(e.block, e.head)]).sum(-1).detach().numpy()
            diff = float(np.abs(out["edge_atp_ld"][:, k] - expected).max())
            assert diff <= 1e-5, f"{e.label}: max diff {diff}"


def test_on_a_tiny_corruption_edge_atp_matches_exact_patching_and_on_a_large_one_it_need_not():
    # float64: at eps 1e-3 an edge's exact effect is about 1e-3 of a logit, where float32's
    # rounding of the two forwards it subtracts (about 1e-7 of a logit) reorders the small edges
    # on some CPUs (rho 0.988 on an AMD EPYC); the linearisation error is what is measured here.
    model = make("plain").double()
    x_clean = images(4, seed=1).double()
    y, contrast = torch.tensor([0, 1, 2, 3]), torch.tensor([3, 4, 0, 1])
    for eps in (1e-2, 1e-3):
        x_corrupt = x_clean + eps * images(4, seed=2).double()
        out = edge_patch_batch(model, x_clean, x_corrupt, y, contrast)
        exact, atp = out["edge_exact_ld"].mean(0), out["edge_atp_ld"].mean(0)
        rho = sps.spearmanr(exact, atp).statistic
        rel = float(np.abs(atp - exact).max() / np.abs(exact).max())
        assert rho >= 0.99 and rel <= 30 * eps, (
            f"eps {eps}: rho {rho:.4f}, relative error {rel:.3g}"
        )
    far = edge_patch_batch(model, x_clean, images(4, seed=9).double() * 3, y, contrast)
    rel = float(
        np.abs(far["edge_atp_ld"] - far["edge_exact_ld"]).max() / np.abs(far["edge_exact_ld"]).max()
    )
    assert rel > 1e-3, "a large corruption should leave AtP's linearisation visibly off"
    assert edge_passes(model) == {
        "exact_forward": 2 + len(edges(model)),
        "atp_forward": 3,
        "atp_backward": 1,
    }


def test_models_without_a_class_token_readout_are_refused():
    with pytest.raises(InterventionError, match="class-token readout"):
        edges(make("mean_pooling"))
