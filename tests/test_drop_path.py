"""Stochastic depth in the glass-box ViT: timm's DropPath and per-block rule; rate 0 is the model it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workbench.convert.timm_vit import UnsupportedTimmModel, config_from_timm, glassbox_from_timm
from workbench.models.vit import ViTConfig, VisionTransformer

TINY = dict(image_size=16, patch_size=4, in_channels=1, num_classes=5, dim=32, depth=4, heads=4)
PLAIN_BLOCK = ["norm1", "attn.qkv", "attn.probs", "attn", "resid1", "norm2", "mlp", "resid2"]


def timm_vit(drop_path_rate: float):
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    torch.manual_seed(0)
    return TimmViT(
        img_size=16,
        patch_size=4,
        in_chans=1,
        num_classes=5,
        embed_dim=32,
        depth=4,
        num_heads=4,
        drop_path_rate=drop_path_rate,
    )


def test_rate_zero_keeps_the_module_tree_parameters_and_stages():
    model = VisionTransformer(ViTConfig(**TINY))
    assert model.cfg.drop_path_rate == 0.0
    assert all(
        type(b.drop_path1) is nn.Identity and type(b.drop_path2) is nn.Identity
        for b in model.blocks
    )
    assert model.stage_names() == ["patch_embed", "pos_add"] + [
        f"blocks.{i}.{s}" for i in range(4) for s in PLAIN_BLOCK
    ] + ["norm", "head"]
    with_rate = VisionTransformer(ViTConfig(**TINY, drop_path_rate=0.3))
    assert list(with_rate.state_dict()) == list(model.state_dict()), (
        "drop path added or renamed a tensor"
    )
    assert with_rate.stage_names() == model.stage_names(), "drop path added a stage"


def test_per_block_rates_are_timms_linear_rule_and_modules():
    ours, theirs = VisionTransformer(ViTConfig(**TINY, drop_path_rate=0.3)), timm_vit(0.3)
    for i, (a, b) in enumerate(zip(ours.blocks, theirs.blocks)):
        for name in ("drop_path1", "drop_path2"):
            mine, timms = getattr(a, name), getattr(b, name)
            assert type(mine) is type(timms), (
                f"block {i} {name}: {type(mine).__name__} vs {type(timms).__name__}"
            )
            assert getattr(mine, "drop_prob", 0.0) == getattr(timms, "drop_prob", 0.0), (
                f"block {i} {name}"
            )
    expected = [0.3 * i / 3 for i in range(4)]
    got = [getattr(b.drop_path1, "drop_prob", 0.0) for b in ours.blocks]
    assert max(abs(g - e) for g, e in zip(got, expected)) < 1e-7, (
        f"rates {got}, expected {expected}"
    )


def test_training_forward_equals_timms_at_zero_difference_and_eval_is_identity():
    theirs = timm_vit(0.5)
    cfg = config_from_timm(theirs)
    assert abs(cfg.drop_path_rate - 0.5) < 1e-7
    ours, _ = glassbox_from_timm(theirs)
    ours.set_fast_attention(True)  # timm's default fused attention: the same kernel
    x = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    theirs.train(), ours.train()
    torch.manual_seed(7)
    a = theirs(x)
    torch.manual_seed(7)
    b = ours(x)
    diff = (a - b).abs().max().item()
    assert diff == 0.0, f"train-mode forward differs from timm's by {diff}"
    ours.eval()
    plain = ours(x)
    assert (plain - b).abs().max().item() > 0, "drop path did nothing in training"
    torch.manual_seed(3)
    again = ours(x)
    assert torch.equal(plain, again), "drop path acted in eval mode"


def test_a_schedule_other_than_timms_rule_is_refused_by_name():
    theirs = timm_vit(0.3)
    theirs.blocks[1].drop_path1.drop_prob = 0.25
    theirs.blocks[1].drop_path2.drop_prob = 0.25
    with pytest.raises(UnsupportedTimmModel, match="linear rule"):
        config_from_timm(theirs)


def test_rate_is_validated():
    with pytest.raises(ValueError, match="drop_path_rate=1.0: must be in"):
        ViTConfig(**TINY, drop_path_rate=1.0)
