"""intervene and attribute on timm arms: a timm ViT arm is acted on through its glass-box config and weights, a
timm CNN arm is refused in one line naming the key and why.

Default tier: no training; the timm models are built on the meta device or at 8 px.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import timm
import torch
import yaml

from workbench.interventions.read_across import NotGlassBoxViT, glassbox_config, trained_glassbox
from workbench.convert.timm_vit import config_from_timm
from workbench.interventions import InterventionError
from workbench.interventions.sources import (
    read_across_note,
    saved_through_fused_attention,
    trained_cell_model,
)
from workbench.models.timm_arm import TimmModelConfig
from workbench.protocol import (
    ProtocolError,
    load_protocol,
    parse_attribution_protocol,
    parse_intervention_protocol,
)

PROTOCOLS = Path(__file__).resolve().parents[1] / "studies" / "protocols"
TIMM_ARMS = load_protocol(PROTOCOLS / "smoke_timm_arms.yaml")
# smoke_timm_arms' timm_vit arm
TIMM_VIT = {
    "num_classes": 10,
    "img_size": 32,
    "patch_size": 4,
    "embed_dim": 64,
    "depth": 2,
    "num_heads": 4,
    "mlp_ratio": 2.0,
}
INTERVENTION = {
    "name": "tiny_timm_heads",
    "description": "heads of the smoke_timm_arms cells, for schema tests",
    "acts_on": {"protocol": "smoke_timm_arms", "hash": TIMM_ARMS.hash},
    "interventions": {"heads": "all", "branches": "all"},
}
ATTRIBUTION = {
    "name": "tiny_timm_faithfulness",
    "description": "attribution on the smoke_timm_arms cells",
    "acts_on": {"protocol": "smoke_timm_arms", "hash": TIMM_ARMS.hash},
    "attribution": {"images": 8},
}
PARSERS = {
    "intervention": (INTERVENTION, parse_intervention_protocol, "interventions act on ViT stages"),
    "attribution": (ATTRIBUTION, parse_attribution_protocol, "attribution maps are read off ViT"),
}


def parsed(kind: str, arms=None, source: Path = PROTOCOLS / "tiny.yaml"):
    base, parse, _ = PARSERS[kind]
    data = copy.deepcopy(base)
    if arms is not None:
        data["acts_on"]["arms"] = arms
    return parse(data, source=str(source))


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_a_timm_vit_arm_is_acted_on_through_the_glass_box_config_of_the_exact_mapping(kind):
    p = parsed(kind)
    # every ViT arm by default: the timm ViT too, not the ResNet
    assert p.arms == ("vit", "timm_vit"), p.arms
    cfg = p.model_config("timm_vit")
    with torch.device("meta"):
        expected = config_from_timm(
            timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM_VIT)
        )
    assert cfg == expected, (cfg, expected)
    assert (
        cfg.image_size,
        cfg.patch_size,
        cfg.dim,
        cfg.depth,
        cfg.heads,
        cfg.mlp_hidden,
        cfg.num_classes,
    ) == (32, 4, 64, 2, 4, 128, 10), cfg
    assert cfg.pooling == "cls" and cfg.class_token and cfg.register_tokens == 0
    assert parsed(kind, ["timm_vit"]).arms == ("timm_vit",)
    if (
        kind == "intervention"
    ):  # the grid is checked against the read-across config: 8 heads x 2, 4 branches, positions
        assert len(p.grid.expand(cfg)) == 2 * 4 * 2 + 2 * 2 + 1


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_a_timm_cnn_arm_is_refused_in_one_line_naming_the_key_and_why(kind):
    with pytest.raises(ProtocolError) as info:
        parsed(kind, ["vit", "resnet10t"])
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(PROTOCOLS / "tiny.yaml") + ": "), message
    why = PARSERS[kind][2]
    assert re.search(
        rf"acts_on\.arms: 'resnet10t' is not a ViT arm \({why}.*\): timm/resnet10t is a timm ResNet, "
        r"not a timm VisionTransformer: no attention heads or tokens to act on; "
        r"ViT arms of smoke_timm_arms: vit, timm_vit$",
        message,
    ), message
    suggested = message.split("ViT arms of smoke_timm_arms: ")[1]
    assert "resnet10t" not in suggested, message  # never suggests a name it refuses


def test_a_timm_vit_option_the_mapping_refuses_is_named_and_never_suggested(tmp_path):
    ablation = yaml.safe_load((PROTOCOLS / "smoke_timm_arms.yaml").read_text())
    # timm builds it; the glass box has no such mode
    ablation["arms"][2]["overrides"]["model"]["dynamic_img_size"] = True
    (tmp_path / "smoke_timm_arms.yaml").write_text(yaml.safe_dump(ablation))
    data = copy.deepcopy(INTERVENTION)
    data["acts_on"]["hash"] = load_protocol(tmp_path / "smoke_timm_arms.yaml").hash
    data["acts_on"]["arms"] = ["timm_vit"]
    with pytest.raises(ProtocolError) as info:
        parse_intervention_protocol(data, source=str(tmp_path / "tiny.yaml"))
    message = str(info.value)
    assert (
        "\n" not in message
        and (
            "acts_on.arms: 'timm_vit' is not a ViT arm (interventions act on ViT stages): "
            "timm/vit_tiny_patch16_224 does not read across to the glass-box ViT: unsupported "
            "timm ViT options: dynamic_img_size=True; ViT arms of smoke_timm_arms: vit"
        )
        in message
    ), message
    assert message.endswith("ViT arms of smoke_timm_arms: vit"), message


def _tiny_timm_vit(**extra) -> tuple[TimmModelConfig, torch.nn.Module]:
    cfg = TimmModelConfig(
        "vit_tiny_patch16_224",
        {
            "num_classes": 3,
            "img_size": 8,
            "patch_size": 4,
            "embed_dim": 16,
            "depth": 2,
            "num_heads": 2,
            "mlp_ratio": 2.0,
            **extra,
        },
    )
    torch.manual_seed(0)
    model = timm.create_model(cfg.architecture, pretrained=False, **cfg.kwargs).eval()
    for p in model.parameters():  # every tensor non-trivial (timm inits some biases to zero)
        torch.nn.init.normal_(p, std=0.2)
    return cfg, model


def test_trained_weights_are_read_across_to_the_glass_box_and_compute_timm_s_function():
    cfg, model = _tiny_timm_vit()
    config = {"model": {"name": cfg.name, "overrides": cfg.kwargs}}
    # timm's default, as the trainer built it
    fused = any(getattr(m, "fused_attn", False) for m in model.modules())
    assert saved_through_fused_attention(config) == fused
    glass, audit = trained_glassbox(cfg, model.state_dict())
    assert audit.complete and not glass.training and glass.cfg == glassbox_config(cfg)
    for m in (
        model.modules()
    ):  # written-out attention on both sides: the same operations in the same order
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    x = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(x) - glass(x)).abs().max().item()
    assert diff == 0.0, f"max |logit difference| {diff}"
    via_config = trained_cell_model(config, model.state_dict())
    assert all(
        torch.equal(a, b)
        for a, b in zip(via_config.state_dict().values(), glass.state_dict().values())
    )
    assert "read across to the glass-box ViT by the exact mapping" in read_across_note(config)
    glass_arm = {"model": {"name": "fmnist_vit", "overrides": {}}}
    assert not saved_through_fused_attention(glass_arm) and read_across_note(glass_arm) == ""


def test_an_arm_trained_with_stochastic_depth_acts_through_its_eval_twin():
    cfg, model = _tiny_timm_vit(drop_path_rate=0.1)
    glass, _ = trained_glassbox(cfg, model.state_dict())
    assert glass.cfg.drop_path_rate == 0.0  # eval mode: DropPath is the identity, the same function
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    with torch.no_grad():
        assert (model(x) - glass(x)).abs().max().item() == 0.0


def test_a_timm_cnn_checkpoint_is_refused_by_name_not_loaded():
    cfg = TimmModelConfig("resnet10t", {"num_classes": 3})
    with pytest.raises(
        NotGlassBoxViT,
        match="timm/resnet10t is a timm ResNet, not a timm VisionTransformer: no "
        "attention heads or tokens",
    ):
        glassbox_config(cfg)
    with pytest.raises(
        InterventionError, match="model 'timm/resnet10t': timm/resnet10t is a timm ResNet"
    ):
        trained_cell_model({"model": {"name": cfg.name, "overrides": cfg.kwargs}}, {})
