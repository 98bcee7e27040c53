"""Glass-box ViT and CNN: parameter counts, stage names, analysis mode, config validation."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from workbench.models.cnn import CNN, CNNConfig
from workbench.models.registry import STUDY_MODELS, build_model, model_config
from workbench.models.vit import ViTConfig, VisionTransformer, count_parameters


def test_fashion_mnist_vit_has_105546_parameters():
    assert count_parameters(build_model(STUDY_MODELS["fmnist_vit"])) == (105_546, 44)


def test_cnn_has_117498_parameters():
    assert count_parameters(CNN(CNNConfig(in_channels=1, num_classes=10)))[0] == 117_498


def test_vit_b16_has_86567656_parameters_in_152_tensors_and_100_stages():
    with torch.device("meta"):
        model = VisionTransformer(ViTConfig())
    assert count_parameters(model) == (86_567_656, 152)
    assert len(model.stage_names()) == 100


def test_analysis_mode_returns_every_stage_and_attention_map():
    cfg = STUDY_MODELS["fmnist_vit"]
    model = VisionTransformer(cfg).eval()
    x = torch.randn(3, 1, 28, 28)
    analysis = model.forward_analysis(x)
    assert list(analysis.hidden_states) == model.stage_names()
    n = cfg.num_patches + 1
    assert len(analysis.attentions) == cfg.depth
    for attn in analysis.attentions:
        assert attn.shape == (3, cfg.heads, n, n)
        assert_close(attn.sum(-1), torch.ones(3, cfg.heads, n), 1e-5, "attention rows sum to 1")
    assert analysis.hidden_states["patch_embed"].shape == (3, cfg.num_patches, cfg.dim)
    assert analysis.hidden_states["pos_add"].shape == (3, n, cfg.dim)
    assert analysis.hidden_states["blocks.2.attn.qkv"].shape == (3, n, 3 * cfg.dim)
    assert analysis.hidden_states["head"].shape == (3, 10)
    assert_close(analysis.logits, model(x), 0.0, "analysis logits vs forward")


def test_fast_path_matches_written_attention_and_analysis_ignores_it():
    model = VisionTransformer(STUDY_MODELS["cifar_vit"]).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        written = model(x)
        fast = model.set_fast_attention(True)(x)
        analysis = model.forward_analysis(x)
    assert_close(fast, written, 1e-5, "sdpa fast path vs written attention")
    assert len(analysis.attentions) == model.cfg.depth  # analysis still has maps on the fast path
    assert all(b.attn.fast for b in model.blocks)  # and restores the setting


def test_mean_pooling_with_registers_and_no_class_token():
    cfg = ViTConfig(
        image_size=16,
        patch_size=4,
        dim=32,
        depth=2,
        heads=2,
        num_classes=5,
        class_token=False,
        pooling="mean",
        register_tokens=2,
        no_embed_class=True,
    )
    model = VisionTransformer(cfg)
    analysis = model.forward_analysis(torch.randn(2, 3, 16, 16))
    assert analysis.attentions[0].shape == (2, 2, 16 + 2, 16 + 2)
    assert model.pos_embed.shape == (1, 16, 32)
    assert list(analysis.hidden_states)[-3:] == ["pool", "fc_norm", "head"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("patch_size", 300, "patch_size=300"),
        ("heads", 5, "heads=5"),
        ("pooling", "max", "pooling='max'"),
        ("pos_embed", "sincos", "pos_embed='sincos'"),
        ("dropout", 1.5, "dropout=1.5"),
        ("class_token", False, "CLS pooling needs class_token"),
    ],
)
def test_bad_config_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ViTConfig(**{field: value})


def test_unknown_override_field_is_named():
    with pytest.raises(ValueError, match="unknown model field.*patchsize"):
        model_config("fmnist_vit", patchsize=8)
    assert model_config("fmnist_vit", pooling="mean").pooling == "mean"


def test_cnn_forward_shapes():
    model = CNN(CNNConfig(in_channels=3, num_classes=7))
    assert model(torch.randn(4, 3, 32, 32)).shape == (4, 7)
    assert model.forward_head(
        model.forward_features(torch.randn(2, 3, 32, 32)), pre_logits=True
    ).shape == (2, 128)


def test_family_options_are_validated_and_a_plain_vit_is_unchanged():
    with pytest.raises(ValueError, match="num_classes=-1"):
        ViTConfig(num_classes=-1)
    with pytest.raises(ValueError, match="act='relu'"):
        ViTConfig(act="relu")
    with pytest.raises(ValueError, match="norm_bias=False: RMSNorm has no bias"):
        ViTConfig(norm_layer="rmsnorm", norm_bias=False)
    with pytest.raises(ValueError, match="even hidden width"):
        ViTConfig(mlp_layer="glu", mlp_hidden=7)
    with pytest.raises(ValueError, match="layer_scale_init=0"):
        ViTConfig(layer_scale_init=0)
    cfg = ViTConfig(
        image_size=(32, 48),
        patch_size=(8, 16),
        dim=32,
        depth=1,
        heads=2,
        num_classes=0,
        pooling="map",
        class_token=False,
        layer_scale_init=0.1,
        norm_layer="rmsnorm",
    )
    model = VisionTransformer(cfg)
    assert cfg.grid == (4, 3) and model.pos_embed.shape == (1, 12, 32)
    out = model(torch.randn(2, 3, 32, 48))
    assert out.shape == (2, 32)  # no classifier: pre-logits features
    with torch.device("meta"):
        names = [n for n, _ in VisionTransformer(ViTConfig()).named_parameters()]
    assert len(names) == 152 and names[:3] == ["cls_token", "pos_embed", "patch_proj.weight"]
