"""The attribution figures render from the arrays of a real (tiny) cell."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.attribution.attribution_figures import (
    concentration_figure,
    curves_figure,
    example_maps_figure,
    norm_histograms_figure,
)
from workbench.analysis.common import display_images, png_bytes
from workbench.attribution import METHODS, score_cell
from workbench.models.vit import ViTConfig, VisionTransformer


@pytest.fixture(scope="module")
def cell():
    torch.manual_seed(0)
    model = VisionTransformer(
        ViTConfig(
            image_size=8,
            patch_size=2,
            in_channels=1,
            num_classes=3,
            dim=16,
            depth=2,
            heads=2,
            mlp_hidden=32,
            register_tokens=1,
        )
    ).eval()
    x = torch.rand(3, 1, 8, 8)
    return x, score_cell(
        model, x, torch.tensor([0, 1, 2]), list(METHODS), seed=0, counts=[0, 4, 8, 12, 16]
    )


def _is_png(fig) -> None:
    data = png_bytes(fig)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_curves_figure_draws_a_band_over_seeds(cell):
    _, c = cell
    seeds = {
        m: np.stack([c.curves.deletion_prob[m].mean(0), c.curves.deletion_prob[m][:2].mean(0)])
        for m in METHODS
    }
    ins = {
        m: np.stack([c.curves.insertion_prob[m].mean(0), c.curves.insertion_prob[m][1:].mean(0)])
        for m in METHODS
    }
    fig = curves_figure(c.curves.fractions, seeds, ins, "tiny ViT")
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == len(METHODS)
    assert len(fig.axes[0].collections) == len(METHODS)  # one band per method
    _is_png(fig)
    with pytest.raises(ValueError, match="has 3 points, the fractions 5"):
        curves_figure(c.curves.fractions, {"random": np.zeros((2, 3))}, ins, "bad")


def test_example_maps_and_norm_histograms_render(cell):
    x, c = cell
    grid = c.norms.layout.grid
    maps = {m: c.scores[m].reshape(-1, *grid) for m in METHODS}
    fig = example_maps_figure(
        display_images(x), maps, c.causal.effects.reshape(-1, *grid), ["a", "b", "c"]
    )
    assert len(fig.axes) == 3 * (2 + len(METHODS))
    _is_png(fig)
    fig = norm_histograms_figure(c.norms.norms, c.norms.median, c.norms.k, "tiny ViT")
    assert len(fig.axes) == 2
    _is_png(fig)


def test_concentration_figure_draws_the_mean_over_seeds_per_block(cell):
    _, c = cell
    k = c.norms.concentration
    entropy = np.stack([k.entropy.mean(axis=0), k.entropy[:2].mean(axis=0)])  # two "seeds" (S, L)
    panels = {
        "entropy": {"heads averaged": entropy},
        "registers": {"on the register": k.registers.mean(0)[None]},
    }
    fig = concentration_figure(panels, "tiny ViT", {"entropy": {"uniform attention": 1.0}})
    # band: 2 seeds
    assert len(fig.axes) == 2 and len(fig.axes[0].collections) == 1 and not fig.axes[1].collections
    drawn = fig.axes[0].lines[0].get_ydata()
    assert np.max(np.abs(drawn - entropy.mean(axis=0))) <= 1e-12, drawn
    assert fig.axes[0].lines[1].get_ydata()[0] == 1.0  # the uniform reference
    _is_png(fig)
