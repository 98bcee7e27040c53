"""Reduced glass-box ViTs with every tensor randomised, for the unit tests of the kinds that act
on trained models (``test_attribution.py``, ``test_interventions.py``).

Every tensor gets its own seeded normal draw, so no default-init constant (a norm's unit weight,
a zero bias, a LayerScale gamma) can hide a swapped or skipped tensor.
"""

from __future__ import annotations

import torch

from workbench.models.vit import ViTConfig, VisionTransformer


def tiny_config(**size) -> dict:
    """The reduced ViT's config keys: dim 16, depth 2, MLP 32, and ``size`` (image and patch size,
    channels, classes, heads), which each kind's tests choose."""
    return dict(dim=16, depth=2, mlp_hidden=32) | size


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, floor: float) -> None:
    """Every tensor its own seeded normal draw, at its RMS (``floor`` at the least): no constant left."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in model.state_dict().values():
        scale = max(tensor.double().pow(2).mean().sqrt().item(), floor)
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)


def random_vit(config: dict, seed: int, floor: float) -> VisionTransformer:
    """A ViT of ``config`` in eval mode, randomised (``randomize``)."""
    model = VisionTransformer(ViTConfig(**config)).eval()
    randomize(model, seed, floor)
    return model
