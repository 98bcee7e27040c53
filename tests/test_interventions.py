"""Interventions on an unmodified glass-box ViT: the mirror is the model, edits do what they say.

Every family is reduced (depth 2, dim 16, 4 heads, 16 x 16 px) with EVERY tensor randomised
(norm weights and biases, LayerScale gammas, tokens, positions): default-init constants would
hide a swapped or skipped tensor.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from random_vits import random_vit, tiny_config

from workbench.interventions import (
    DropTokens,
    HeadAblation,
    InterventionError,
    InterventionSet,
    PatchStage,
    SkipBranch,
    ZeroPosEmbed,
    capture,
    head_means,
    parse,
    patchable_stages,
    run,
)
from workbench.models.vit import VisionTransformer

BASE = tiny_config(image_size=16, patch_size=4, in_channels=3, num_classes=5, heads=4)
FAMILIES = {
    "plain": {},
    "layerscale_registers": dict(layer_scale_init=0.1, register_tokens=2),
    "qk_norm_inner_norms": dict(qk_norm=True, scale_attn_norm=True, scale_mlp_norm=True),
    "mean_pooling": dict(pooling="mean"),
    "attention_pool": dict(pooling="map", class_token=False),
    "no_class_token": dict(
        class_token=False, pooling="mean", register_tokens=1, no_embed_class=True
    ),
    "clip_like_swiglu": dict(
        norm_pre=True, embed_norm=True, patch_bias=False, act="quick_gelu", mlp_layer="swiglu"
    ),
    "rmsnorm_glu_no_positions": dict(
        norm_layer="rmsnorm", mlp_layer="glu", act="silu", pos_embed="none"
    ),
}


def make(family: str, seed: int = 0, **extra) -> VisionTransformer:
    return random_vit({**BASE, **FAMILIES[family], **extra}, seed, floor=0.02)


def images(n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (
        (actual.double() - expected.double()).abs().max().item()
        if actual.shape == expected.shape
        else float("inf")
    )
    assert torch.equal(actual, expected), f"{what}: not bitwise equal, max |difference| {diff:.3g}"


def hooks_of(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hooks_that_edit_nothing_leave_the_forward_bitwise_and_capture_is_its_analysis(family):
    from workbench.models.hooks import attached

    model, x = make(family), images()
    plain = model(x)
    with attached(model, [(stage, lambda a: None) for stage in model.stage_names()]):
        same(model(x), plain, f"{family}: every hook point hooked vs model(x)")
    logits, acts = capture(model, x)
    analysis = model.forward_analysis(x)
    same(logits, analysis.logits, f"{family}: capture logits vs forward_analysis")
    assert set(acts) == set(patchable_stages(model.cfg)) and set(acts) <= set(
        analysis.hidden_states
    )
    for stage, value in acts.items():
        same(value, analysis.hidden_states[stage], f"{family}: stage {stage}")
    # the fused path too: hooks on the probs switch it off for the call only
    model.set_fast_attention(True)
    fused = model(x)
    with attached(
        model,
        [(stage, lambda a: None) for stage in model.stage_names() if not stage.endswith("probs")],
    ):
        same(
            model(x),
            fused,
            f"{family}: every hook point but the maps hooked vs model(x), fast attention",
        )
    assert all(m.fast for m in model.modules() if hasattr(m, "fast")), (
        "the fast path was not restored"
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_intervention_is_the_model_itself_and_nothing_stays_hooked(family):
    model, x = make(family), images()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    same(run(model, x), model(x), f"{family}: run without interventions")
    run(
        model,
        x,
        [HeadAblation(1, 2), SkipBranch(0, "mlp"), PatchStage("blocks.1.attn.qkv")],
        patches={
            "blocks.1.attn.qkv": capture(model, x, ["blocks.1.attn.qkv"])[1]["blocks.1.attn.qkv"]
        },
    )
    assert hooks_of(model) == 0, "a hook outlived its call"
    assert not any(getattr(m, "fast", False) for m in model.modules()), "the fast-path flag changed"
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()), (
        "an intervention changed a weight"
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patching_every_stage_with_its_own_activation_is_the_identity(family):
    model, x = make(family), images()
    intact = model(x)
    _, acts = capture(model, x)
    for stage, value in acts.items():
        same(
            run(model, x, [PatchStage(stage)], patches={stage: value}),
            intact,
            f"{family}: {stage} patched with itself",
        )


def test_patching_the_last_residual_with_another_examples_activation_gives_that_examples_output():
    model, x = make("plain"), images(4)
    _, acts = capture(model, x, ["blocks.1.resid2"])
    rolled = acts["blocks.1.resid2"].roll(1, dims=0)  # example k gets example k-1's residual stream
    same(
        run(model, x, [PatchStage("blocks.1.resid2")], patches={"blocks.1.resid2": rolled}),
        model(x).roll(1, dims=0),
        "patched last residual",
    )


@pytest.mark.parametrize(
    "family", ["plain", "layerscale_registers", "qk_norm_inner_norms", "attention_pool"]
)
def test_zero_ablating_every_head_is_skipping_the_branch_except_for_out_proj_bias(family):
    """All heads zero: out_proj(0) = its bias, so the branch adds ls1(bias); skipping adds nothing."""
    model, x = make(family), images()
    all_heads = [HeadAblation(1, h) for h in range(model.cfg.heads)]
    bias = model.blocks[1].attn.out_proj.bias.detach()
    # What is left of the branch is exactly its bias at every token: patch the branch output to it.
    tokens = capture(model, x, ["blocks.1.attn"])[1]["blocks.1.attn"]
    left = bias.expand_as(tokens).clone()
    same(
        run(model, x, all_heads),
        run(model, x, [PatchStage("blocks.1.attn")], patches={"blocks.1.attn": left}),
        f"{family}: every head zeroed vs branch output = out_proj bias",
    )
    assert not torch.equal(run(model, x, all_heads), run(model, x, [SkipBranch(1, "attn")])), (
        "with a random bias the two must differ (else the test cannot fail)"
    )
    with torch.no_grad():
        model.blocks[1].attn.out_proj.bias.zero_()
    same(
        run(model, x, all_heads),
        run(model, x, [SkipBranch(1, "attn")]),
        f"{family}: every head zeroed vs attention branch skipped (bias zeroed)",
    )


def _head_outputs(model: VisionTransformer, x: torch.Tensor, block: int) -> torch.Tensor:
    """Heads concatenated (B, N, C), rebuilt from the analysis stages qkv and probs (not from out_proj's input)."""
    states = model.forward_analysis(x).hidden_states
    B, N, C = (
        states[f"blocks.{block}.attn.qkv"].shape[0],
        states[f"blocks.{block}.attn.qkv"].shape[1],
        model.cfg.dim,
    )
    H = model.cfg.heads
    # (B, H, N, d)
    v = states[f"blocks.{block}.attn.qkv"].reshape(B, N, 3, H, C // H)[:, :, 2].transpose(1, 2)
    return (states[f"blocks.{block}.attn.probs"] @ v).transpose(1, 2).reshape(B, N, C)


def test_mean_ablation_uses_the_reference_sets_per_head_mean():
    model, x = make("plain"), images(3)
    reference = images(7, seed=5)
    means = head_means(model, [reference[:3], reference[3:]])  # batching must not matter
    assert means.images == 7
    expected = _head_outputs(model, reference, 0).double().mean(dim=0)  # (N, C) per token position
    diff = (means.per_block[0].double() - expected).abs().max().item()
    assert diff <= 1e-6, (
        f"reference mean vs mean rebuilt from qkv and probs: max |difference| {diff:.3g}"
    )

    # Head 2 of block 0 replaced by its reference mean; the other heads keep this input's values.
    heads = _head_outputs(model, x, 0).reshape(3, -1, 4, 4).clone()  # (B, N, H, d)
    heads[:, :, 2] = expected.float().reshape(-1, 4, 4)[:, 2]
    wanted = model.blocks[0].attn.out_proj(heads.reshape(3, -1, 16))
    _, got = capture(
        model, x, ["blocks.0.attn"], interventions=[HeadAblation(0, 2, "mean")], head_means=means
    )
    diff = (got["blocks.0.attn"] - wanted).abs().max().item()
    assert diff <= 1e-6, f"mean-ablated attention output: max |difference| {diff:.3g}"
    zeroed = capture(model, x, ["blocks.0.attn"], interventions=[HeadAblation(0, 2, "zero")])[1][
        "blocks.0.attn"
    ]
    assert (zeroed - got["blocks.0.attn"]).abs().max() > 1e-3, "zero and mean ablation must differ"

    # a reference set of the input itself: its mean is its own value, the model unchanged
    one = x[:1]
    same(
        run(model, one, [HeadAblation(0, 2, "mean")], head_means=head_means(model, [one])),
        model(one),
        "mean over a reference set of the input itself",
    )


def test_zeroing_the_position_embedding_is_the_model_with_a_zero_pos_embed():
    model, x = make("layerscale_registers"), images()
    zero = torch.func.functional_call(model, {"pos_embed": torch.zeros_like(model.pos_embed)}, (x,))
    same(
        run(model, x, [ZeroPosEmbed()]),
        zero,
        "pos_embed.zero vs functional_call with zero pos_embed",
    )
    assert not torch.equal(zero, model(x))


@pytest.mark.parametrize(
    "family,tokens",
    [
        ("layerscale_registers", "registers"),
        ("no_class_token", "registers"),
        ("mean_pooling", "class"),
    ],
)
def test_dropping_tokens_is_the_model_built_without_them(family, tokens):
    model, x = make(family), images()
    cfg = model.cfg
    smaller = (
        replace(cfg, register_tokens=0)
        if tokens == "registers"
        else replace(cfg, class_token=False)
    )
    state = dict(model.state_dict())
    if tokens == "registers":
        del state["register_tokens"]
        drop = range(int(cfg.class_token), int(cfg.class_token) + cfg.register_tokens)
    else:
        del state["cls_token"]
        drop = range(0, 1)
    if not cfg.no_embed_class:  # positions cover the prefix tokens too: drop their rows
        keep = [i for i in range(state["pos_embed"].shape[1]) if i not in drop]
        state["pos_embed"] = state["pos_embed"][:, keep]
    reference = VisionTransformer(smaller).eval()
    reference.load_state_dict(state, strict=True)
    got, want = run(model, x, [DropTokens(tokens)]), reference(x)
    diff = (got - want).abs().max().item()
    assert diff <= 1e-6, (
        f"{family}: {tokens} dropped vs model built without them: max |difference| {diff:.3g}"
    )
    assert not torch.equal(got, model(x))


def test_a_set_applies_all_of_its_interventions_together():
    model, x = make("plain"), images()
    both = InterventionSet("first_block", (SkipBranch(0, "attn"), SkipBranch(0, "mlp")))
    same(
        run(model, x, [both]),
        run(model, x, [SkipBranch(0, "attn"), SkipBranch(0, "mlp")]),
        "set vs its items",
    )
    assert both.name == "set.first_block"


def test_names_parse_back():
    for item in (
        HeadAblation(1, 3, "mean"),
        SkipBranch(2, "mlp"),
        ZeroPosEmbed(),
        DropTokens("class"),
        PatchStage("blocks.0.resid1"),
        PatchStage("pos_add"),
    ):
        assert parse(item.name) == item, item.name
    with pytest.raises(InterventionError, match="not a known form"):
        parse("blocks.0.attn.head1.halve")


@pytest.mark.parametrize(
    "family,items,message",
    [
        (
            "plain",
            [PatchStage("blocks.2.attn")],
            r"unknown stage 'blocks.2.attn'; valid stages: patch_embed, pos_add, "
            r"blocks.\{0-1\}.\{norm1, attn.qkv, attn.probs, attn, resid1",
        ),
        ("plain", [HeadAblation(0, 4)], r"head 4 does not exist; valid heads: 0-3 \(4 per block\)"),
        ("plain", [SkipBranch(2, "mlp")], r"block 2 does not exist; valid blocks: 0-1"),
        ("plain", [DropTokens("registers")], "no register tokens"),
        ("plain", [DropTokens("class")], "pools with the class token"),
        ("rmsnorm_glu_no_positions", [ZeroPosEmbed()], "no position embedding"),
        ("attention_pool", [PatchStage("attn_pool.probs")], "computes its map inline"),
        (
            "layerscale_registers",
            [DropTokens("registers"), PatchStage("blocks.0.resid1")],
            "changes the shape",
        ),
        (
            "layerscale_registers",
            [DropTokens("registers"), HeadAblation(0, 0, "mean")],
            "per token position",
        ),
        (
            "plain",
            [SkipBranch(0, "attn"), PatchStage("blocks.0.attn.qkv")],
            "never computes that stage",
        ),
        ("plain", [SkipBranch(0, "attn"), SkipBranch(0, "attn")], "given more than once"),
        ("plain", [HeadAblation(0, 1, "mean")], "needs the reference means"),
        ("plain", [PatchStage("blocks.0.resid1")], "no stored activation"),
    ],
)
def test_bad_interventions_are_one_line_errors_naming_the_valid_values(family, items, message):
    model = make(family)
    with pytest.raises(InterventionError, match=message) as info:
        run(model, images(), items)
    assert "\n" not in str(info.value)


def test_a_model_in_training_mode_and_a_stored_activation_of_the_wrong_shape_are_refused():
    model, x = make("plain"), images()
    with pytest.raises(InterventionError, match="shape"):
        run(
            model,
            x,
            [PatchStage("blocks.0.resid1")],
            patches={"blocks.0.resid1": torch.zeros(3, 5, 16)},
        )
    with pytest.raises(InterventionError, match="model.eval"):
        run(model.train(), x, [SkipBranch(0, "mlp")])


@pytest.mark.parametrize("family", ["plain", "layerscale_registers", "attention_pool"])
def test_resuming_from_a_blocks_input_is_the_whole_forward(family):
    from workbench.interventions.forward import block_inputs

    model, x = make(family), images()
    logits, cache = block_inputs(model, x)
    same(logits, model(x), f"{family}: block_inputs logits vs model(x)")
    _, acts = capture(model, x, ["blocks.1.resid2"])
    for start, items in [
        (1, [HeadAblation(1, 3)]),
        (0, [SkipBranch(0, "mlp")]),
        (2, [PatchStage("head")]),
        (1, [PatchStage("blocks.1.resid1"), HeadAblation(1, 0)]),
    ]:
        patches = {"head": logits.roll(1, 0), "blocks.1.resid1": acts["blocks.1.resid2"]}
        full = run(model, x, items, patches=patches)
        same(
            run(model, x, items, patches=patches, resume=(start, cache[start])),
            full,
            f"{family}: {items} from block {start}",
        )
    with pytest.raises(InterventionError, match="edit block 0 or earlier"):
        run(model, x, [SkipBranch(0, "attn")], resume=(1, cache[1]))


def test_evaluate_gives_each_examples_outcome_whatever_the_batching():
    from workbench.data import NormStats
    from workbench.interventions.evaluate import Inputs, derangement, evaluate, reference_means

    model = make("plain", pooling="cls")
    gen = torch.Generator().manual_seed(3)
    uint8 = torch.randint(0, 256, (10, 3, 16, 16), dtype=torch.uint8, generator=gen)
    labels, indices = torch.randint(0, 5, (10,), generator=gen), torch.arange(100, 110)
    grid = [
        HeadAblation(0, 1),
        HeadAblation(1, 2, "mean"),
        SkipBranch(1, "mlp"),
        PatchStage("blocks.0.resid2"),
    ]
    norm = NormStats((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    means, chosen = reference_means(model, uint8, 4, 0, Inputs(norm, 3, torch.device("cpu")))
    assert len(set(chosen)) == 4 and means.images == 4
    a = evaluate(
        model,
        uint8,
        labels,
        indices,
        Inputs(norm, 3, torch.device("cpu")),
        grid,
        means,
        patch_seed=1,
    )
    b = evaluate(
        model,
        uint8,
        labels,
        indices,
        Inputs(norm, 10, torch.device("cpu")),
        grid,
        means,
        patch_seed=1,
    )
    assert a.names == [i.name for i in grid] and a.predicted.shape == (4, 10)
    assert np.array_equal(a.predicted, b.predicted) and np.array_equal(
        a.intact_predicted, b.intact_predicted
    )
    assert np.abs(a.loss - b.loss).max() <= 1e-6, np.abs(a.loss - b.loss).max()
    x = (uint8.float() / 255 - 0.5) / 0.25
    want = run(model, x, [grid[1]], head_means=means)
    assert np.array_equal(a.predicted[1], want.argmax(-1).numpy()), (
        "mean-ablated head, whole batch at once"
    )
    source = a.patch_sources["blocks.0.resid2.patch"]
    assert np.array_equal(source, derangement(10, 1)) and not np.any(source == np.arange(10))
    _, acts = capture(model, x[torch.from_numpy(source)], ["blocks.0.resid2"])
    patched = run(model, x, [grid[3]], patches={"blocks.0.resid2": acts["blocks.0.resid2"]})
    assert np.array_equal(a.predicted[3], patched.argmax(-1).numpy())
    m = a.metrics()
    assert m["blocks.0.attn.head1.zero"]["accuracy"] == float(
        (a.predicted[0] == labels.numpy()).mean()
    )
    assert a.attention.shape == (2, 4, 4, 4) and np.allclose(
        a.attention.sum(axis=(2, 3)) <= 1 + 1e-6, True
    )
