"""The glass-box ViT is the same function as timm's: 0.0 difference at every stage in fp32.

Tolerance is exactly 0.0 for stages and gradients: both models run the same operations
in the same order on CPU, so any difference at all is a bug.
"""

from __future__ import annotations

import pytest

from workbench.convert.timm_weights import load_timm_weights
from workbench.equivalence import randomize_every_tensor, run_equivalence

SLOW = pytest.mark.slow
# (timm architecture, batch, compare gradients) -- the largest models use batch 1.
# Full-size models beyond the tiny ones are in the slow tier; the default tier proves the
# same options at reduced size (tests/test_equivalence_families.py: plain, gap, registers).
MODELS = [
    ("vit_tiny_patch16_224", 2, True),
    pytest.param("deit_tiny_patch16_224", 2, True, marks=SLOW),  # vit_tiny's options exactly
    pytest.param("vit_small_patch16_224", 2, True, marks=SLOW),
    pytest.param("vit_small_patch16_384", 1, True, marks=SLOW),
    pytest.param("vit_base_patch16_224", 2, True, marks=SLOW),
    pytest.param("vit_base_patch32_384", 2, True, marks=SLOW),
    pytest.param("vit_base_patch8_224", 1, True, marks=SLOW),
    pytest.param("vit_large_patch16_224", 1, True, marks=SLOW),
    pytest.param("vit_base_patch16_gap_224", 2, True, marks=SLOW),  # no class token, mean pooling
    # 4 registers, mean pooling, fc_norm
    pytest.param("vit_base_patch16_reg4_gap_256", 2, True, marks=SLOW),
]


def describe_failures(report) -> str:
    bad = [s for s in report.stages if not s.passed][:8]
    lines = [report.summary()] + [
        f"  stage {s.index} {s.stage}: max |diff| {s.max_abs_diff:.3g}" for s in bad
    ]
    grads = report.gradients[report.gradients.max_abs_diff > report.tolerance].head(8)
    lines += [f"  grad {r.tensor}: max |diff| {r.max_abs_diff:.3g}" for r in grads.itertuples()]
    return "\n".join(lines)


@pytest.mark.parametrize("name, batch, gradients", MODELS)
def test_every_stage_and_gradient_is_exactly_equal(name, batch, gradients):
    weights = load_timm_weights(name, "random", seed=0)
    randomize_every_tensor(weights.model, seed=0)  # timm's constant norms and biases hide swaps
    report = run_equivalence(
        weights.model, name, batch=batch, seed=0, tolerance=0.0, gradients=gradients
    )
    assert report.passed, describe_failures(report)
    assert report.max_abs_diff == 0.0, describe_failures(report)
    assert report.audit.complete


def test_vit_b16_mapping_counts_without_allocating_weights():
    import timm
    import torch

    from workbench.convert.timm_vit import config_from_timm, map_timm_state_dict
    from workbench.models.vit import VisionTransformer

    with torch.device("meta"):
        model = timm.create_model("vit_base_patch16_224", pretrained=False)
        cfg = config_from_timm(model)
        glass = VisionTransformer(cfg)
    _, audit = map_timm_state_dict(model.state_dict(), cfg)
    assert (audit.source_used, audit.source_tensors, audit.target_filled, audit.target_tensors) == (
        152,
        152,
        152,
        152,
    )
    assert audit.parameters == 86_567_656
    assert len(glass.stage_names()) == 100


@pytest.mark.slow
def test_vit_b16_counts():
    weights = load_timm_weights("vit_base_patch16_224", "random", seed=1)
    randomize_every_tensor(weights.model, seed=1)
    report = run_equivalence(
        weights.model, "vit_base_patch16_224", batch=1, seed=1, gradients=False
    )
    assert (report.audit.source_used, report.audit.source_tensors) == (152, 152)
    assert (report.audit.target_filled, report.audit.target_tensors) == (152, 152)
    assert report.audit.parameters == 86_567_656
    assert (report.stages_passed, len(report.stages)) == (100, 100), describe_failures(report)
    # fused attention is reported, not asserted: it must be present and small
    for name, rows in report.fused.items():
        assert len(rows) == 100 - 12, name  # no attention maps on the fused path
        assert max(r.max_abs_diff for r in rows) < 1e-3, name


def test_a_real_difference_is_detected_at_the_stage_where_it_starts():
    import torch

    from workbench.convert.timm_vit import glassbox_from_timm
    from workbench.equivalence import compare_stages, set_timm_fused, timm_forward_stages

    model = load_timm_weights("vit_tiny_patch16_224", "random", seed=0).model
    set_timm_fused(model, False)
    glass, _ = glassbox_from_timm(model)
    with torch.no_grad():
        model.blocks[6].mlp.fc2.bias[0] += 1e-4  # timm now differs from its glass-box copy
        x = torch.randn(1, 3, 224, 224)
        _, ref = timm_forward_stages(model, x, glass)
        _, ours = glass.forward_stages(x)
    rows = compare_stages(ref, ours, glass.stage_names(), 0.0)
    first_bad = next(r for r in rows if not r.passed)
    assert first_bad.stage == "blocks.6.mlp"
    assert all(r.passed for r in rows if r.index < first_bad.index)
    assert not rows[-1].passed
