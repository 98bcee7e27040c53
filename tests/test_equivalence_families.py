"""timm's ViT families (CLIP, DINOv2, SigLIP, DeiT III, EVA, AIMv2, BEiT3, ...) at exactly 0.0.

The family matrix runs one reduced-size model per option combination (2 blocks, width
64, 4x4 patches): ``check_architecture`` proves that the reduced model keeps every
option of the full-size one before comparing, so the same op sequence is exercised in
seconds. Full-size checks of CLIP B/16, DINOv2 S/14 and SigLIP B/16 are in the slow tier.
Tolerance is exactly 0.0 for every stage and every parameter gradient.
"""

from __future__ import annotations

from functools import partial

import pytest
import timm
import torch

from workbench.convert.timm_vit import UnsupportedTimmModel, config_from_timm
from workbench.equivalence import randomize_every_tensor, run_equivalence
from workbench.equivalence_coverage import check_architecture, option_signature, reduced_model

# (timm architecture, what it exercises)
FAMILIES = [
    ("vit_base_patch16_224", "plain ViT"),
    ("vit_base_patch16_gap_224", "no class token, mean pooling, fc_norm"),
    ("vit_base_patch16_clip_224", "CLIP: norm_pre, patch projection without bias, eps 1e-5"),
    ("vit_base_patch16_clip_quickgelu_224", "OpenAI CLIP: QuickGELU"),
    ("vit_small_patch14_dinov2", "DINOv2: LayerScale, no classifier"),
    ("vit_small_patch14_reg4_dinov2", "DINOv2 with 4 registers"),
    ("vit_giant_patch14_dinov2", "DINOv2 giant: SwiGLU packed (GluMlp, SiLU, gate first)"),
    ("vit_base_patch16_siglip_224", "SigLIP: attention-pool head, no class token, no classifier"),
    ("vit_so400m_patch16_siglip_256", "SigLIP 2: tanh GELU, attention pool"),
    ("vit_base_patch16_siglip_gap_224", "SigLIP mean pooling without fc_norm"),
    ("deit3_small_patch16_224", "DeiT III: LayerScale, position embedding without the class token"),
    ("eva_large_patch14_196", "EVA (vision_transformer module)"),
    ("aimv2_large_patch14_224", "AIMv2: RMSNorm, SwiGLU, norm inside patch embed, no biases"),
    ("beit3_base_patch16_224", "BEiT3: scale_attn_norm, scale_mlp_norm"),
    ("vit_medium_patch16_reg4_gap_256", "registers, mean pooling, LayerScale"),
    ("test_vit3", "attention pool over prefix tokens too (pool_include_prefix)"),
]

# Options no registered architecture uses by default, switched on through timm's kwargs.
SMALL = dict(embed_dim=64, depth=2, num_heads=2, img_size=64, patch_size=16, num_classes=10)
KWARG_OPTIONS = [
    ("qk_norm", dict(qk_norm=True)),
    ("layernorm_without_bias", dict(norm_layer=partial(timm.layers.LayerNorm, bias=False))),
    ("no_qkv_proj_mlp_bias", dict(qkv_bias=False, proj_bias=False)),
    ("final_norm_false_no_classifier", dict(final_norm=False, global_pool="avg", num_classes=0)),
    ("silu_mlp", dict(act_layer="silu")),
    ("glu_mlp_gate_last", dict(mlp_layer=timm.layers.GluMlp, act_layer="sigmoid")),
    ("swiglu_unpacked_gelu_tanh", dict(mlp_layer=timm.layers.SwiGLU, act_layer="gelu_tanh")),
    ("non_square_image_and_patch", dict(img_size=(48, 64), patch_size=(16, 8))),
    ("mean_pool_with_prefix", dict(global_pool="avg", pool_include_prefix=True, reg_tokens=2)),
    ("map_pool_with_class_token", dict(global_pool="map", fc_norm=True)),
    ("rmsnorm_layerscale_norm_pre", dict(norm_layer="rmsnorm", init_values=0.1, pre_norm=True)),
    # read across as ViTConfig.drop_path_rate (tests/test_drop_path.py)
    (
        "stochastic_depth",
        dict(drop_path_rate=0.1),
    ),
]


def describe(report) -> str:
    bad = [s for s in report.stages if not s.passed][:6]
    lines = [report.summary()] + [
        f"  stage {s.stage}: max |diff| {s.max_abs_diff:.3g}" for s in bad
    ]
    grads = report.gradients[report.gradients.max_abs_diff > report.tolerance].head(6)
    return "\n".join(
        lines + [f"  grad {r.tensor}: max |diff| {r.max_abs_diff:.3g}" for r in grads.itertuples()]
    )


@pytest.mark.parametrize("name, what", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_matches_exactly_at_reduced_size(name, what):
    row = check_architecture(name, batch=2, seed=0, tolerance=0.0)
    assert row.verdict == "match", f"{name} ({what}): {row}"
    assert row.max_stage_diff == 0.0 and row.max_gradient_diff == 0.0, row


@pytest.mark.parametrize("label, kwargs", KWARG_OPTIONS, ids=[k[0] for k in KWARG_OPTIONS])
def test_option_matches_exactly(label, kwargs):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**SMALL, **kwargs})
    randomize_every_tensor(model, seed=0)
    report = run_equivalence(model, label, batch=2, seed=0, tolerance=0.0)
    assert report.passed and report.max_abs_diff == 0.0, describe(report)


def test_reduced_model_keeps_every_option_of_the_full_one():
    with torch.device("meta"):
        full = config_from_timm(timm.create_model("vit_small_patch14_reg4_dinov2"))
    small = config_from_timm(reduced_model("vit_small_patch14_reg4_dinov2", full))
    assert option_signature(small) == option_signature(full)
    assert (small.dim, small.depth) == (64, 2) and (full.dim, full.depth) == (384, 12)
    assert full.layer_scale_init == 1e-5 and full.register_tokens == 4 and full.num_classes == 0


def test_plain_vit_stage_list_is_unchanged_and_options_add_named_stages():
    from workbench.models.vit import ViTConfig, VisionTransformer

    with torch.device("meta"):
        plain = VisionTransformer(ViTConfig()).stage_names()
        clip = VisionTransformer(
            ViTConfig(norm_pre=True, layer_scale_init=1e-5, qk_norm=True)
        ).stage_names()
        siglip = VisionTransformer(
            ViTConfig(pooling="map", class_token=False, num_classes=0)
        ).stage_names()
    assert len(plain) == 100 and plain[:4] == [
        "patch_embed",
        "pos_add",
        "blocks.0.norm1",
        "blocks.0.attn.qkv",
    ]
    assert {"norm_pre", "blocks.0.ls1", "blocks.0.ls2", "blocks.0.attn.q_norm"} <= set(clip)
    assert siglip[-8:] == [
        "norm",
        "attn_pool.kv",
        "attn_pool.probs",
        "attn_pool.attn",
        "attn_pool.norm",
        "attn_pool.mlp",
        "pool",
        "head",
    ]


def test_attention_pool_map_is_a_stage_of_the_analysis_mode():
    with torch.device("meta"):
        full = config_from_timm(timm.create_model("vit_base_patch16_siglip_224"))
    from workbench.convert.timm_vit import glassbox_from_timm

    glass, _ = glassbox_from_timm(reduced_model("vit_base_patch16_siglip_224", full))
    analysis = glass.forward_analysis(torch.randn(2, 3, 64, 64))
    assert analysis.pool_attention.shape == (2, 2, 1, 16)  # (B, heads, one latent, 16 patches)
    assert torch.allclose(analysis.pool_attention.sum(-1), torch.ones(2, 2, 1), atol=1e-6)
    assert analysis.logits.shape == (2, 64)  # no classifier: pre-logits features


REFUSED = [
    ("vit_tiny_r_s16_p8_224", {}, "HybridEmbed patch embedding"),
    ("deit_tiny_distilled_patch16_224", {}, "distillation token"),
    ("vit_small_patch16_18x2_224", {}, "block_fn=ParallelThingsBlock"),
    ("vit_base_patch16_rpn_224", {}, "block_fn=ResPostBlock"),
    ("vit_base_patch16_xp_224", {}, "block_fn=ParallelScalingBlock"),
    ("vit_dpwee_patch16_reg1_gap_256", {}, "block_fn=DiffParallelScalingBlock"),
    ("vit_dwee_patch16_reg1_gap_256", {}, "attn_layer=DiffAttention"),
    ("vit_intern300m_patch14_448", {}, "dynamic_img_size=True"),
    ("vit_tiny_patch16_224", {"patch_drop_rate": 0.1}, "patch_drop_rate > 0"),
    ("vit_tiny_patch16_224", {"global_pool": "max"}, "global_pool='max'"),
    ("vit_tiny_patch16_224", {"global_pool": "prr"}, "global_pool='prr'"),
    ("vit_tiny_patch16_224", {"act_layer": "relu"}, "act_layer=ReLU"),
    ("vit_tiny_patch16_224", {"dynamic_img_pad": True}, "dynamic_img_pad=True"),
]


@pytest.mark.parametrize("name, kwargs, option", REFUSED, ids=[f"{r[0]}-{r[2]}" for r in REFUSED])
def test_unsupported_options_are_refused_by_name_without_a_crash(name, kwargs, option):
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **kwargs)
    with pytest.raises(UnsupportedTimmModel) as err:
        config_from_timm(model)
    assert option in str(err.value)


def test_hybrid_and_distilled_are_refused_rows_in_the_coverage():
    for name in ("vit_tiny_r_s16_p8_224", "deit_tiny_distilled_patch16_224"):
        row = check_architecture(name)
        assert row.verdict == "refused" and row.reason, row


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["vit_base_patch16_clip_224", "vit_small_patch14_dinov2", "vit_base_patch16_siglip_224"]
)
def test_full_size_family_model_matches_exactly(name):
    from workbench.convert.timm_weights import load_timm_weights

    weights = load_timm_weights(name, "random", seed=0)
    randomize_every_tensor(weights.model, seed=0)
    report = run_equivalence(weights.model, name, batch=1, seed=0, tolerance=0.0)
    assert report.passed and report.max_abs_diff == 0.0, describe(report)
