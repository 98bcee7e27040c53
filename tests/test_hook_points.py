"""Hook points: the one forward's named stages, their order, their names, attaching and detaching."""

from __future__ import annotations

import copy

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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("fast", [False, True])
def test_attn_z_is_each_heads_output_before_out_proj_on_both_paths(family, fast):
    """``blocks.i.attn.z`` (B, N, heads, d), reshaped, is the input of the projection after it."""
    model, x = make(family), images()
    model.set_fast_attention(fast)
    cfg = model.cfg
    z: dict[str, torch.Tensor] = {}
    proj_in: list[torch.Tensor] = []
    after = "norm" if cfg.scale_attn_norm else "out_proj"  # the module right after the heads
    module = getattr(model.blocks[1].attn, after)
    handle = module.register_forward_pre_hook(lambda _m, args: proj_in.append(args[0]))
    try:
        with attached(model, [("blocks.1.attn.z", lambda a: z.setdefault("z", a))]):
            model(x)
    finally:
        handle.remove()
    B, N = x.shape[0], cfg.num_prefix_tokens + cfg.num_patches
    assert z["z"].shape == (B, N, cfg.heads, cfg.dim // cfg.heads)
    diff = (z["z"].reshape(B, N, cfg.dim) - proj_in[0]).abs().max().item()
    assert diff == 0.0, f"{family} fast={fast}: z vs the heads concatenated, max diff {diff}"


def test_finer_hook_points_are_addressable_but_not_stages():
    model = make("plain")
    points = hook_points(model)
    finer = [n for n, p in points.items() if not p.stage]
    assert finer == ["pos_embed"] + [f"blocks.{i}.attn.z" for i in range(model.cfg.depth)]
    assert not set(finer) & set(model.stage_names())
    assert list(hook_points(model, stages_only=True)) == model.stage_names()
    with pytest.raises(KeyError, match="finer hook points: pos_embed, blocks.0.attn.z"):
        with attached(model, [("blocks.9.attn.z", lambda a: None)]):
            pass


def test_the_unhooked_forward_is_bitwise_the_forward_without_the_finer_points():
    """With nothing attached, the forward with the finer points equals one with them removed."""
    model, x = make("plain"), images()
    plain = model(x)
    stripped = copy.deepcopy(model)
    stripped.hook_pos_embed = torch.nn.Identity()
    for block in stripped.blocks:
        block.attn.hook_z = torch.nn.Identity()
    assert torch.equal(stripped(x), plain)


def test_a_zero_position_term_through_its_hook_point_is_the_model_with_a_zero_pos_embed():
    model, x = make("plain"), images()
    with attached(model, [("pos_embed", torch.zeros_like)]):
        hooked = model(x)
    zeros = {"pos_embed": torch.zeros_like(model.pos_embed)}
    expected = torch.func.functional_call(model, zeros, (x,), strict=False)
    diff = (hooked - expected).abs().max().item()
    assert diff == 0.0, f"pos_embed hook vs functional_call: max diff {diff}"
    assert not torch.equal(hooked, model(x))
