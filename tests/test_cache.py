"""run_with_cache / run_with_hooks: names both ways, per-block stacking, hooks gone after the call."""

from __future__ import annotations

import pytest
import timm
import torch

from test_interventions import FAMILIES, hooks_of, images, make, same
from workbench.interventions import InterventionError, hook_paths
from workbench.interventions.cache import (
    hook_name,
    hook_path,
    run_with_cache,
    run_with_hooks,
)
from workbench.models.hooks import HookPoint


def _intermediates_nlc(model, x) -> torch.Tensor:
    """forward_intermediates' block outputs with the prefix tokens put back: (L, B, N, D)."""
    pairs = model.forward_intermediates(
        x, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True
    )
    if not model.num_prefix_tokens:
        return torch.stack(pairs)
    return torch.stack([torch.cat([p, s], dim=1) for s, p in pairs])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cache_of_an_unhooked_forward_is_forward_intermediates_and_the_logits_are_the_models(
    family,
):
    model, x = make(family), images()
    logits, cache = run_with_cache(model, x)
    same(logits, model(x), f"{family}: logits under the cache")
    stacked = cache.stack("resid2")
    assert stacked.shape[:2] == (model.cfg.depth, x.shape[0])
    expected = _intermediates_nlc(model, x)
    diff = (stacked - expected).abs().max().item()
    assert diff == 0.0, f"{family}: cache.stack('resid2') vs forward_intermediates: {diff}"
    assert list(cache) == list(hook_paths(model)), "the cache is not every hook point in order"
    z = cache.stack("attn.z")
    assert z.shape == (model.cfg.depth, x.shape[0], stacked.shape[2], 4, 4)  # dim 16, 4 heads
    assert hooks_of(model) == 0, "a hook stayed attached"


def test_names_and_module_paths_map_both_ways_and_get_submodule_finds_the_hook_point():
    model = make("clip_like_swiglu")
    for name, path in hook_paths(model).items():
        point = model.get_submodule(path)
        assert isinstance(point, HookPoint) and point.name == name
        assert hook_path(model, name) == path and hook_name(model, path) == name
    assert hook_path(model, "blocks.0.resid1") == "blocks.0.hook_resid1"
    assert hook_path(model, "blocks.1.attn.z") == "blocks.1.attn.hook_z"
    assert hook_path(model, "patch_embed.norm") == "hook_patch_embed_norm"
    with pytest.raises(InterventionError, match="no hook point 'blocks.0.attn.out_proj'"):
        hook_path(model, "blocks.0.attn.out_proj")


def test_names_filter_takes_a_name_a_path_a_list_or_a_predicate():
    model, x = make("plain"), images()
    _, one = run_with_cache(model, x, names_filter="blocks.1.resid2")
    _, by_path = run_with_cache(model, x, names_filter=["blocks.1.hook_resid2", "pos_embed"])
    _, pred = run_with_cache(model, x, names_filter=lambda n: n.endswith("attn.z"))
    assert list(one) == ["blocks.1.resid2"]
    assert list(by_path) == ["pos_embed", "blocks.1.resid2"]
    assert list(pred) == ["blocks.0.attn.z", "blocks.1.attn.z"]
    same(one["blocks.1.hook_resid2"], one["blocks.1.resid2"], "indexing by module path")
    with pytest.raises(KeyError, match="no 'blocks.i.mlp' in the cache"):
        one.stack("mlp")


def test_run_with_hooks_edits_one_call_and_removes_every_hook_even_on_error():
    model, x = make("plain"), images()
    plain = model(x)
    seen = []

    def zero_head(z, hook):
        seen.append(hook.name)
        z = z.clone()
        z[:, :, 1] = 0.0
        return z

    edited = run_with_hooks(model, x, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
    assert seen == ["blocks.0.attn.z"] and not torch.equal(edited, plain)
    # the same edit at out_proj's input, by hand
    handle = model.blocks[0].attn.out_proj.register_forward_pre_hook(
        lambda _m, a: (a[0].index_fill(2, torch.arange(4, 8), 0.0),)
    )
    try:
        by_hand = model(x)
    finally:
        handle.remove()
    same(edited, by_hand, "head 1 zeroed through attn.z vs at out_proj's input")

    def boom(a, hook):
        raise RuntimeError("inside a hook")

    with pytest.raises(RuntimeError, match="inside a hook"):
        run_with_hooks(model, x, fwd_hooks=[("blocks.0.mlp", boom), ("head", boom)])
    assert hooks_of(model) == 0, "a hook outlived an error"
    same(model(x), plain, "the forward after the calls")


def test_the_cache_sees_what_the_rest_of_the_forward_saw():
    model, x = make("plain"), images()
    _, cache = run_with_cache(
        model, x, ["blocks.0.attn"], fwd_hooks=[("blocks.0.attn", lambda a, h: 2 * a)]
    )
    _, intact = run_with_cache(model, x, ["blocks.0.attn"])
    same(cache["blocks.0.attn"], 2 * intact["blocks.0.attn"], "cache after the edit")


def test_a_timm_vit_runs_through_its_exact_glass_box_copy():
    torch.manual_seed(0)
    tm = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=3
    ).eval()
    for m in tm.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False  # the written-out attention: the comparison is exact
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, cache = run_with_cache(tm, x, names_filter=lambda n: n.endswith("resid2"))
        expected = tm(x)
        timm_blocks = tm.forward_intermediates(
            x, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True
        )
    diff = (logits - expected).abs().max().item()
    assert diff == 0.0, f"timm logits vs its glass-box copy under the cache: {diff}"
    timm_stack = torch.stack([torch.cat([p, s], dim=1) for s, p in timm_blocks])
    diff = (cache.stack("resid2") - timm_stack).abs().max().item()
    assert diff == 0.0, f"cache.stack('resid2') vs timm's forward_intermediates: {diff}"
    with pytest.raises(InterventionError, match="Linear: no glass-box copy: .*only timm"):
        run_with_hooks(torch.nn.Linear(2, 2), x)
