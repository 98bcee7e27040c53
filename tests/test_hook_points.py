"""Hook points: the one forward's named stages, their order, their names, attaching and detaching."""

from __future__ import annotations

import pytest
import torch

from test_interventions import FAMILIES, images, make
from workbench.models.hooks import HookPoint, attached, hook_points
from workbench.models.vit import ViTConfig, VisionTransformer, stage_names_of

PLAIN_BLOCK = ["norm1", "attn.qkv", "attn.probs", "attn", "resid1", "norm2", "mlp", "resid2"]


def test_a_plain_vits_stage_list_is_the_vocabulary():
    names = VisionTransformer(
        ViTConfig(image_size=16, patch_size=4, dim=32, depth=2, heads=4, num_classes=5)
    ).stage_names()
    assert names == ["patch_embed", "pos_add"] + [
        f"blocks.{i}.{s}" for i in range(2) for s in PLAIN_BLOCK
    ] + ["norm", "head"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stage_names_are_the_execution_order_and_named_from_the_module_path(family):
    model, x = make(family), images()
    fired: list[str] = []
    with attached(model, [(s, lambda a, s=s: fired.append(s)) for s in model.stage_names()]):
        model(x)
    assert fired == model.stage_names(), (
        f"{family}: hooks fired in another order than stage_names lists"
    )
    for path, module in model.named_modules():
        if isinstance(module, HookPoint):
            parent = path.rpartition(".")[0]
            assert module.name == (
                f"{parent}.{module.local_name}" if parent else module.local_name
            ), path
    assert stage_names_of(model.cfg) == model.stage_names(), (
        "the meta-device list differs from the model's"
    )


def test_hooks_are_gone_after_the_call_and_an_unknown_stage_names_the_valid_ones():
    model, x = make("plain"), images()
    with pytest.raises(KeyError, match="no hook point 'blocks.9.attn'.*patch_embed, pos_add"):
        with attached(
            model, [("blocks.0.attn", lambda a: None), ("blocks.9.attn", lambda a: None)]
        ):
            pass
    assert all(not p._forward_hooks for p in hook_points(model).values()), "a hook stayed attached"
    doubled = model(x)
    with attached(
        model, [("blocks.1.resid2", lambda a: 2 * a)]
    ):  # a replacement is what the rest of the body sees
        edited = model(x)
    assert not torch.equal(edited, doubled)
    assert torch.equal(model(x), doubled), "the forward after the call is not the plain one"
