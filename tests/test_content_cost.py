"""workbench.bench.cost: parameters, FLOPs per image and throughput against independent counts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from workbench.models.registry import build_model, model_config
from workbench.models.vit import ViTConfig
from workbench.bench import cost


def real_count(name: str, overrides: dict, shape: tuple[int, ...]) -> tuple[int, int]:
    """Parameters and forward FLOPs of a model built for real on the CPU (the independent check)."""
    model = build_model(model_config(name, **overrides)).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros((1, *shape)))
    return sum(p.numel() for p in model.parameters()), int(counter.get_total_flops())


@pytest.mark.parametrize(
    "name,overrides,shape",
    [
        ("fmnist_vit", {}, (1, 28, 28)),
        ("fmnist_cnn", {}, (1, 28, 28)),
        ("cifar_vit", {"patch_size": 8, "dim": 96, "heads": 4}, (3, 32, 32)),
        ("cifar_vit", {"pooling": "mean", "class_token": False}, (3, 32, 32)),
    ],
)
def test_model_cost_equals_real_model_counts(name, overrides, shape):
    params, flops = real_count(name, overrides, shape)
    got = cost.model_cost(name, overrides, image_size=shape[-1])
    assert got.parameters == params == got.trainable_parameters, (got.parameters, params)
    assert got.forward_flops == flops, (
        f"analytic {got.forward_flops} vs counted {flops}: diff {got.forward_flops - flops}"
    )
    assert (
        got.train_flops is not None
        and 2 * got.forward_flops < got.train_flops <= 3 * got.forward_flops
    )
    assert cost.counted_flops(build_model(model_config(name, **overrides)), shape) == flops


def test_published_study_model_sizes():
    assert cost.model_cost("fmnist_vit").parameters == 105_546
    assert cost.model_cost("fmnist_cnn", image_size=28).parameters == 117_498
    unknown = cost.model_cost("fmnist_cnn")
    assert unknown.forward_flops is None and "input size" in unknown.method
    with pytest.raises(ValueError, match="image_size=32 but the ViT config says 28"):
        cost.model_cost("fmnist_vit", image_size=32)


def test_regime_trainable_parameters():
    cfg = ViTConfig(
        image_size=32, patch_size=8, in_channels=3, num_classes=5, dim=32, depth=4, heads=2
    )
    model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    head = cfg.dim * 5 + 5
    block = sum(p.numel() for p in model.blocks[0].parameters())
    norm = 2 * cfg.dim
    linear, partial, full = (
        cost.vit_regime_cost(cfg, "linear"),
        cost.vit_regime_cost(cfg, "partial", 2),
        cost.vit_regime_cost(cfg, "full"),
    )
    assert (
        linear.trainable_parameters,
        partial.trainable_parameters,
        full.trainable_parameters,
    ) == (head, 2 * block + norm + head, total)
    assert linear.parameters == partial.parameters == full.parameters == total
    assert full.train_flops is not None and linear.train_flops is None


def test_training_cost_and_arm_summary():
    run = cost.training_cost(
        120.0, 10, train_size=3200, device="cpu", precision="off", train_flops_per_image=1_000_000
    )
    assert run.images_seen == 32_000 and abs(run.images_per_second - 32_000 / 120) < 1e-12
    assert abs(run.achieved_flops_per_second - 1e6 * 32_000 / 120) < 1e-3
    other = cost.training_cost(80.0, 7, images_seen=22_400, device="cuda", precision="off")
    summary = cost.arm_cost([run, other])
    assert abs(summary.mean_wall_seconds - 100.0) < 1e-12 and summary.total_wall_seconds == 200.0
    assert summary.epochs_run == [10, 7] and summary.devices == ["cpu", "cuda"]
    assert abs(summary.mean_images_per_second - (32_000 / 120 + 22_400 / 80) / 2) < 1e-9
    with pytest.raises(ValueError, match="wall_seconds=0"):
        cost.training_cost(0, 1, images_seen=1)
    with pytest.raises(ValueError, match="images_seen or train_size"):
        cost.training_cost(1.0, 1)


@pytest.mark.slow  # imports timm and builds ViT-B/16 on the meta device: several seconds
def test_timm_vit_config_matches_the_source_architecture():
    cfg = cost.timm_vit_config("vit_base_patch16_224", num_classes=5)
    assert (cfg.image_size, cfg.patch_size, cfg.dim, cfg.depth, cfg.heads, cfg.num_classes) == (
        224,
        16,
        768,
        12,
        12,
        5,
    )
    full = cost.vit_regime_cost(cfg, "full")
    # timm's own count for this architecture with a 5-class head
    assert full.parameters == 85_802_501
    # FlopCounterMode on the timm model with a 5-class head
    assert full.forward_flops == 35_126_128_128
